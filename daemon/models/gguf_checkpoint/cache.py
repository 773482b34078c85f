"""Dequantized GGUF weights kept as a safetensors file, so that a restart reads them instead of
dequantizing the GGUF file again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import structlog
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from daemon.models.gguf_checkpoint.keys import file_key

log = structlog.get_logger(__name__)


def cache_file(directory: Path, gguf_file: Path, dtype: torch.dtype) -> Path:
    """Where the weights of `gguf_file` loaded as `dtype` are kept."""
    return directory / f"{file_key(gguf_file, dtype)}.safetensors"


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def read_into(model: nn.Module, file: Path) -> bool:
    """Fill every parameter and buffer of `model` from `file`; False (the model untouched or
    partly filled, to be loaded from the GGUF file) where the file is missing, unreadable or
    does not hold exactly the model's tensors at their shapes and dtypes. Each is copied once
    from a mapping of the file into the model's own memory: parameters left in file-backed
    pages get no huge pages, and decoding one sequence reads every weight each token."""
    if not file.is_file():
        return False
    targets = _targets(model)
    try:
        tensors = _mapped(file)
        if tensors.keys() != targets.keys():
            log.warning("weight_cache_mismatch", file=str(file))
            return False
        for name, tensor in tensors.items():
            target = targets[name]
            if tensor.shape != target.shape or tensor.dtype != target.dtype:
                log.warning("weight_cache_mismatch", file=str(file), tensor=name)
                return False
        for name, tensor in tensors.items():
            targets[name].data.copy_(tensor)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        # a truncated or damaged file: load from the GGUF
        log.warning("weight_cache_unreadable", file=str(file), error=str(e))
        return False
    return True


_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _mapped(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors `file` as views of one private (copy-on-write) mapping of
    it; one of a dtype not listed, or not aligned to its element size, is read by safetensors
    (a copy)."""
    size = file.stat().st_size
    with file.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{file.name}: bad safetensors header length {n}")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    start = 8 + n
    storage = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=size)
    data = torch.empty(0, dtype=torch.uint8).set_(storage)
    out: dict[str, torch.Tensor] = {}
    copied: list[str] = []
    for name, entry in header.items():
        begin, end = (start + o for o in entry["data_offsets"])
        dtype = _DTYPES.get(entry["dtype"])
        if end > size or begin > end:
            raise ValueError(f"{file.name}: tensor {name!r} lies outside the file")
        if dtype is None or begin % dtype.itemsize:
            copied.append(name)
            continue
        out[name] = data[begin:end].view(dtype).view(entry["shape"])
    if copied:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.update({name: f.get_tensor(name) for name in copied})
    return out


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
