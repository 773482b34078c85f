"""Device and dtype selection: cuda, npu (torch_npu imported only when chosen) and cpu."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

from daemon.build.config import DEVICES, DTYPES
from daemon.models.loader import DENSE_TYPES
from kernels import cpu_build, packed_linear

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


# /proc/cpuinfo flags of instructions that compute bf16 natively (x86: AVX512-BF16, AMX-BF16;
# aarch64: FEAT_BF16); without one, torch emulates bf16 arithmetic in fp32 at a loss
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The native-bf16 flags this CPU reports (BF16_FLAGS order); elsewhere than Linux, what
    torch's own probe of AVX512-BF16 / AMX says."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        probes = (
            ("avx512_bf16", "_is_avx512_bf16_supported"),
            ("amx_bf16", "_is_amx_tile_supported"),
        )
        return tuple(f for f, probe in probes if getattr(torch.cpu, probe, lambda: False)())
    flags: set[str] = set()
    for line in text.splitlines():  # x86 says "flags", aarch64 "Features"
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return tuple(f for f in BF16_FLAGS if f in flags)


def resolve_dtype(
    name: str,
    checkpoint_dtype: str | None,
    device: torch.device,
    cpu_bf16: tuple[str, ...] | None = None,
    widened_bf16: Callable[[], bool] | None = None,
) -> torch.dtype:
    """`name`, or for "auto" the checkpoint's dtype, but on a CPU: bf16 for a bf16 (or
    quantized) checkpoint where the CPU computes bf16 natively (`cpu_bf16`: its flags, None =
    read them) or where the model's kernels widen bf16 to fp32 on this CPU (`widened_bf16`,
    asked only then: SmolLM2 on 2 Ice Lake cores, `bench.peers`, bf16 / fp32 1.65x at one
    sequence, 0.96x at 16, 1.06x at 64), else fp32; a float32 checkpoint is served in float32
    as stored."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use {_one_of(DTYPES)}")
        return _DTYPES[name]
    dtype = _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if device.type != "cpu":
        return dtype
    flags = cpu_bf16_flags() if cpu_bf16 is None else cpu_bf16
    if dtype == torch.bfloat16 and flags:
        chosen, why = torch.bfloat16, "bf16 checkpoint, native bf16 on this CPU"
    elif dtype == torch.bfloat16 and widened_bf16 is not None and widened_bf16():
        chosen, why = torch.bfloat16, "bf16 checkpoint, the model's kernels widen it to fp32"
    elif dtype == torch.bfloat16:
        chosen, why = torch.float32, "no native bf16 on this CPU: torch would emulate it"
    elif dtype == torch.float16:
        chosen, why = torch.float32, "float16 is slow on a CPU"
    else:
        chosen, why = torch.float32, "float32 checkpoint, served as stored"
    log.info(
        "cpu_dtype",
        checkpoint_dtype=checkpoint_dtype,
        dtype=str(chosen).removeprefix("torch."),
        why=why,
        native_bf16=list(flags),
    )
    return chosen


def kernels_widen_bf16(model_type: str | None) -> bool:
    """Whether a model of `model_type` runs bf16 on this CPU through kernels that widen it to
    fp32: a dense one (its linears, decode and prefill attention, fused decode layers) on an
    AVX-512 CPU without bf16 arithmetic, the C++ kernels built. DeepSeek-V4's expert GEMMs
    would run oneDNN's emulated bf16 there."""
    return model_type in DENSE_TYPES and cpu_build.has_avx512() and packed_linear.widens_bf16()


def _one_of(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"
