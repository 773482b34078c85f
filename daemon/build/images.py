"""A vision-language model's image embeddings: the content-hash cache over the encoder on this
node's device, or over encoder nodes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch

from daemon.build.config import EngineConfig
from daemon.loop.images import DeviceImageEncoder, ImageEmbeddings, ImageEncoder
from daemon.models.base import VisionLanguageModel

# (the model, its image fingerprint in hex, this node's own encoder) -> the encoder its images
# go to
RemoteEncoder = Callable[[VisionLanguageModel, str, ImageEncoder], ImageEncoder]


def image_embeddings(
    cfg: EngineConfig,
    model: Any,
    device: torch.device,
    hf_config: dict,
    dtype: torch.dtype,
    remote: RemoteEncoder | None = None,
) -> ImageEmbeddings | None:
    """None for a model that takes no images. The fingerprint binds embeddings to the model's
    config and dtype: an encoder node must serve the same."""
    if not isinstance(model, VisionLanguageModel):
        return None
    fingerprint = hashlib.sha256(
        (json.dumps(hf_config, sort_keys=True) + str(dtype)).encode()
    ).digest()
    local = DeviceImageEncoder(model, device)
    encoder = remote(model, fingerprint.hex(), local) if remote else local
    return ImageEmbeddings(encoder, fingerprint, int(cfg.image_cache_memory_gb * 2**30))
