"""Linear layers on a CPU through oneDNN, the weights packed once into its blocked layout, as the
torch op `deepinfer::packed_linear` (reference: `F.linear`); a few rows go to the plain weight
instead. Which copy and which rows follow the CPU (`plan`). The op and the table of packed
weights are C++ (csrc/packed_linear.cpp) where the kernels build, else Python."""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cpu_build, small_linear

# DEEPINFER_CPU_KERNELS=0 keeps the plain F.linear (read once, at import)
ENABLED = os.environ.get("DEEPINFER_CPU_KERNELS", "1") != "0"
# the rows oneDNN is told to expect when it packs: any count runs on the packed weight after;
# SmolLM2-135M's layers at 64 rows ran 1.41x plain with weights packed for 16, 1.22x for 64
PACK_ROWS = 16
# up to this many rows go to `small_linear` where the CPU has bf16 arithmetic: SmolLM2-135M's
# 30 layers and head on 2 Zen 5 cores, weights from memory, 1.05-1.18x oneDNN's packed GEMM at
# 1 row, 1.02-1.21x at 2; at 4 and 8 rows 0.84-1.11x from run to run, level in the engine at 4
SMALL_ROWS = 2
# fp32 rows MKL's `F.linear` takes on an Intel CPU without AMX: SmolLM2-135M's linears on 2
# Xeon (Ice Lake) cores (`bench.cpu_kernels linear`, its MKL and widened arms: the widened one
# is oneDNN's packed fp32 GEMM plus the rows' conversions) 27.1 ms plain against 44.2 packed
# at 1 row, 28.6 / 43.1 at 2, then 83.6 / 53.9 at 8, 138.0 / 53.1 at 16
PLAIN_FP32_ROWS = 2

_Key = tuple[int, tuple[int, ...], tuple[int, ...]]
# weight (by storage, shape and strides) -> (its version counter when packed, the packed copy,
# the rows that run on the plain weight instead)
_packed: dict[_Key, tuple[int, torch.Tensor, int]] = {}


@dataclass(frozen=True)
class Plan:
    """How one weight's linears run: on oneDNN's packed copy of it, widened to fp32 first if
    `widen` (a bf16 weight on a CPU without bf16 arithmetic, where oneDNN's emulated bf16 GEMM
    ran SmolLM2's linears 2.0x slower than its fp32 one at 16 rows, 2.8x at 64: the same sums
    of the same values, the output rounded to bf16), and up to `small_rows` rows on the plain
    weight (bf16: `small_linear`; fp32: MKL's `F.linear`)."""

    widen: bool = False
    small_rows: int = 0


def plan(weight: torch.Tensor) -> Plan | None:
    """This CPU's plan for a 2-d weight, None to keep the plain `F.linear`:
    - bf16 with bf16 instructions (AVX512-BF16 or AMX): packed, SMALL_ROWS to `small_linear`
      (SmolLM2-135M's 30 layers, 2 Xeon cores with AMX: 26.1 ms plain against 20.6 packed at
      16 rows, 35.5 against 27.5 at 64);
    - bf16 without them, where the C++ op builds: widened, and up to `small_linear.MAX_ROWS`
      rows to `small_linear` where it serves (AVX-512: fp32 FMAs on half fp32's bytes;
      SmolLM2's linears on 2 Ice Lake cores at 1 / 8 rows 15.1 / 29.7 ms against oneDNN's
      bf16 28.1 / 79.1, widened 44.2 / 53.9 and MKL's fp32 27.1 / 83.6);
    - fp32 where `packs_fp32`, rows up to PLAIN_FP32_ROWS plain on Intel."""
    if not (
        ENABLED
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    ):
        return None
    if weight.dtype == torch.bfloat16:
        if _cpu_has_bf16_gemm():
            few = small_linear.supports(weight[:1], weight, SMALL_ROWS)
            return Plan(small_rows=SMALL_ROWS if few else 0)
        if widens_bf16():
            few = small_linear.supports(weight[:1], weight)
            return Plan(widen=True, small_rows=small_linear.MAX_ROWS if few else 0)
        return None
    if weight.dtype == torch.float32 and packs_fp32():
        return Plan(small_rows=0 if _cpu_is_amd() else PLAIN_FP32_ROWS)
    return None


def widens_bf16() -> bool:
    """Whether bf16 weights run widened to fp32 on this CPU: it has no bf16 arithmetic, and
    the C++ op (which keeps the widened copies) builds."""
    return (
        ENABLED
        and torch.backends.mkldnn.is_available()
        and not _cpu_has_bf16_gemm()
        and cpu_build.available()
    )


def supported(weight: torch.Tensor) -> bool:
    """Whether `pack` packs this weight on this CPU."""
    return plan(weight) is not None


@functools.cache
def _cpu_has_bf16_gemm() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _cpuinfo(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _cpu_is_amd(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    return "AuthenticAMD" in _cpuinfo(cpuinfo)


@functools.cache
def packs_fp32(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether fp32 weights are packed: on AMD CPUs, where `F.linear` runs MKL's GEMM off its
    Intel fast paths (SmolLM2-135M's 30 layers on 2 AMD EPYC Zen 5 cores: 28.2 ms plain
    against 9.3 packed at 16 rows, 97.7 against 30.0 at 64, 6.3 against 4.3 at 1), and on
    Intel CPUs without AMX (2 Ice Lake cores: 138.0 against 53.1 ms at 16 rows); on a Xeon
    with AMX fp32 gained nothing, MKL's GEMM as fast there."""
    text = _cpuinfo(cpuinfo)
    if "AuthenticAMD" in text:
        return True
    return "GenuineIntel" in text and " amx_tile" not in text


def pack(weight: torch.Tensor, how: Plan | None = None) -> bool:
    """Pack `weight` [out, in] for `linear` by `how` (default: this CPU's `plan`); whether it
    was. The packed copy lives while the weight does, beside it, so a model's weights are
    twice in memory (three times for a widened bf16 one; a data-less stand-in in the weight's
    place, as vLLM's CPU path leaves, ran the compiled decode slower: 287 against 393 tok/s at
    16 sequences); it is made again if the weight is written in place."""
    how = plan(weight) if how is None else how
    if how is None:
        return False
    key = _key(weight)
    if cpu_build.available():  # the C++ op keeps the table
        with torch.no_grad():
            torch.ops.deepinfer.packed_linear_pack(
                weight.detach(), PACK_ROWS, how.small_rows, how.widen
            )
        ptr, (n, k), (s0, s1) = key
        weakref.finalize(weight, torch.ops.deepinfer.packed_linear_forget, ptr, n, k, s0, s1)
        return True
    if how.widen or (how.small_rows and weight.dtype != torch.float32):
        return False  # small_linear and the widened copy are the C++ op's
    _python_op()
    _packed[key] = (weight._version, _reorder(weight), how.small_rows)
    weakref.finalize(weight, _packed.pop, key, None)
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on `weight`'s packed copy (`pack` first; else the plain op)."""
    return torch.ops.deepinfer.packed_linear(x, weight, bias)


def _key(weight: torch.Tensor) -> _Key:
    return (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()))


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def _lookup(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    key = _key(weight)
    entry = _packed.get(key)
    if entry is None:
        return None
    version, packed, small_rows = entry
    if version != weight._version:  # written since it was packed
        packed = _reorder(weight)
        _packed[key] = (weight._version, packed, small_rows)
    return packed, small_rows


# defined through torch.library's low-level calls: a `custom_op` wrapper adds ~15 us a call (a
# step of SmolLM2 makes 121); implemented in C++ once the kernels load, else by `_python_op`
torch.library.define(
    "deepinfer::packed_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
)


@functools.cache
def _python_op() -> None:
    """The op in Python, where the C++ kernels cannot be built (one implementation or the
    other: both for one key is an error)."""
    torch.library.impl("deepinfer::packed_linear", "CPU")(_packed_linear)


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    entry = _lookup(weight)
    if entry is None or x.dtype != weight.dtype or x.numel() // x.shape[-1] <= entry[1]:
        return F.linear(x, weight, bias)
    packed = entry[0]
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("deepinfer::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
