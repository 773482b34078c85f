"""Device and dtype selection: cuda, npu (torch_npu imported only when chosen) and cpu."""

from __future__ import annotations

import importlib

import structlog
import torch

from daemon.build.config import DEVICES, DTYPES

log = structlog.get_logger(__name__)

_DTYPES = {  # DTYPES, and the aliases a checkpoint's config may name them by
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "npu":
        try:
            importlib.import_module("torch_npu")  # registers the npu backend with torch
        except ImportError as e:
            raise RuntimeError("needs the `ascend` extra (torch-npu) and the CANN toolkit") from e
        return torch.device("npu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; use {_one_of(DEVICES)}")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use {_one_of(DTYPES)}")
        return _DTYPES[name]
    dtype = _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if device.type == "cpu" and dtype != torch.float32:
        # Half precision on CPU is slow without AMX and loses accuracy; serve in fp32.
        log.info("cpu_dtype_upcast", checkpoint_dtype=checkpoint_dtype, dtype="float32")
        return torch.float32
    return dtype


def _one_of(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"
