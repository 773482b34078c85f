"""Dequantized GGUF weights kept as a safetensors file, so that a restart reads them instead of
dequantizing the GGUF file again."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import structlog
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

log = structlog.get_logger(__name__)

# Raise when what is kept of a GGUF file changes (names, q/k row order, dequantization, the
# config or tokenizer built from its metadata): older cache files then stop matching.
FORMAT = 1


def file_key(gguf_file: Path, *parts: object) -> str:
    """A name for what is kept of `gguf_file` (with `parts`): its path, size and modification
    time, so a changed file misses."""
    st = gguf_file.stat()
    key = "|".join(map(str, (gguf_file.resolve(), st.st_size, st.st_mtime_ns, *parts, FORMAT)))
    return f"{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def cache_file(directory: Path, gguf_file: Path, dtype: torch.dtype) -> Path:
    """Where the weights of `gguf_file` loaded as `dtype` are kept."""
    return directory / f"{file_key(gguf_file, dtype)}.safetensors"


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def read_into(model: nn.Module, file: Path) -> bool:
    """Fill every parameter and buffer of `model` from `file`; False (the model untouched or
    partly filled, to be loaded from the GGUF file) where the file is missing, unreadable or
    does not hold exactly the model's tensors at their shapes and dtypes."""
    if not file.is_file():
        return False
    targets = _targets(model)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            if keys != targets.keys():
                log.warning("weight_cache_mismatch", file=str(file))
                return False
            for name in keys:
                tensor = f.get_tensor(name)
                target = targets[name]
                if tensor.shape != target.shape or tensor.dtype != target.dtype:
                    log.warning("weight_cache_mismatch", file=str(file), tensor=name)
                    return False
                target.data.copy_(tensor)
    except (SafetensorError, OSError) as e:  # a truncated or damaged file: load from the GGUF
        log.warning("weight_cache_unreadable", file=str(file), error=str(e))
        return False
    return True


def write_from(model: nn.Module, file: Path) -> None:
    """Keep `model`'s parameters and buffers in `file`, written whole or not at all; a failure
    (a full disk, say) is logged and costs only the next start's time."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().to("cpu").contiguous() for name, t in _targets(model).items()}
        save_file(state, str(tmp))
        os.replace(tmp, file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("weight_cache_not_written", file=str(file), error=str(e))
