"""A vision-language model's image embeddings: the content-hash cache over the encoder on this
node's device."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from daemon.build.config import EngineConfig
from daemon.loop.images import DeviceImageEncoder, ImageEmbeddings
from daemon.models.base import VisionLanguageModel


def image_embeddings(
    cfg: EngineConfig, model: Any, device: torch.device, hf_config: dict, dtype: torch.dtype
) -> ImageEmbeddings | None:
    """None for a model that takes no images."""
    if not isinstance(model, VisionLanguageModel):
        return None
    fingerprint = hashlib.sha256(
        (json.dumps(hf_config, sort_keys=True) + str(dtype)).encode()
    ).digest()
    return ImageEmbeddings(
        DeviceImageEncoder(model, device), fingerprint, int(cfg.image_cache_memory_gb * 2**30)
    )
