"""A model's fingerprint: nodes pair (prefill with decode) only when theirs are equal, i.e. they
serve the same model with the same KV layout. The weights' bytes are sampled, not hashed whole
(a big checkpoint would take minutes)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from daemon.kv.spec import KVGroup

VERSION = b"deepinfer-node-fingerprint-1"
# files that change what a prompt's tokens are or how a model runs
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 64 * 1024  # read from each weight file's middle


def kv_layout(groups: Iterable[KVGroup]) -> list[str]:
    """The cache's layout as text: each group's spec (kind, block size, dtype, shapes) and layers."""
    return [f"{g.spec!r} layers={list(g.layer_ids)}" for g in groups]


def model_fingerprint(path: Path, hf_config: dict[str, Any], layout: Sequence[str]) -> str:
    """sha256 (hex) of the canonical config, the tokenizer files, the KV layout, and each weight
    file's name, size and a sample of its bytes. `path`: a checkpoint directory or a GGUF file."""
    h = hashlib.sha256(VERSION)
    _part(h, b"config", json.dumps(hf_config, sort_keys=True, separators=(",", ":")).encode())
    _part(h, b"kv", "\n".join(layout).encode())
    directory = path if path.is_dir() else path.parent
    for name in TOKENIZER_FILES:
        file = directory / name
        if file.is_file():
            _part(h, name.encode(), file.read_bytes())
    weights = [path] if path.is_file() else sorted(directory.iterdir())
    for file in weights:
        if file.suffix in WEIGHT_SUFFIXES and file.is_file():
            size = file.stat().st_size
            _part(h, f"weights {file.name} {size}".encode(), _sample(file, size))
    return h.hexdigest()


def _part(h: Any, label: bytes, data: bytes) -> None:
    # lengths first: no two different sequences of parts hash the same
    h.update(len(label).to_bytes(8, "little") + label + len(data).to_bytes(8, "little") + data)


def _sample(file: Path, size: int) -> bytes:
    with file.open("rb") as f:
        f.seek(max(0, size // 2 - SAMPLE_BYTES // 2))
        return f.read(SAMPLE_BYTES)
