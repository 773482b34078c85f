"""A vision-language model's image embeddings: the content-hash cache (host memory, then the
block store where the node has one) over the encoder on this node's device, or over encoder
nodes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from daemon.build.config import EngineConfig
from daemon.kv.block_store import BlockStore
from daemon.loop.images import DeviceImageEncoder, EmbeddingStore, ImageEmbeddings, ImageEncoder
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
    budget = int(cfg.image_cache_memory_gb * 2**30)
    return ImageEmbeddings(encoder, fingerprint, budget, _store(cfg, model, fingerprint))


def _store(
    cfg: EngineConfig, model: VisionLanguageModel, fingerprint: bytes
) -> EmbeddingStore | None:
    """The embeddings' files in the node's block store (`--kv-store-dir`), under a fingerprint
    of their own: the KV blocks' sweeper keeps them by the same retention and watermarks."""
    if not cfg.kv_store_dir or not cfg.prefix_caching:
        return None
    shape = (model.image_tokens, model.hidden_size)
    store = BlockStore(
        Path(cfg.kv_store_dir).expanduser(),
        hashlib.blake2b(b"image embeddings" + fingerprint, digest_size=16).digest(),
        shape[0] * shape[1] * 4,
        fsync=cfg.kv_store_fsync,
        io_threads=2,
        read_timeout_s=cfg.kv_store_read_timeout_s,
    )
    return EmbeddingStore(store, shape)
