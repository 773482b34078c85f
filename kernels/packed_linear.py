"""Linear layers on a CPU through oneDNN, the weights packed once into its blocked layout (bf16
with bf16 instructions; fp32 on AMD), as the torch op `deepinfer::packed_linear` (reference:
`F.linear`); a few bf16 rows go to `small_linear` instead, on the plain weight. The op and the
table of packed weights are C++ (csrc/packed_linear.cpp) where the kernels build, else Python."""

from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cpu_build, small_linear

# DEEPINFER_CPU_KERNELS=0 keeps the plain F.linear (read once, at import)
ENABLED = os.environ.get("DEEPINFER_CPU_KERNELS", "1") != "0"
# the rows oneDNN is told to expect when it packs: any count runs on the packed weight after;
# SmolLM2-135M's layers at 64 rows ran 1.41x plain with weights packed for 16, 1.22x for 64
PACK_ROWS = 16
# up to this many rows go to `small_linear` where it serves: SmolLM2-135M's 30 layers and head
# on 2 Zen 5 cores, weights from memory, 1.05-1.18x oneDNN's packed GEMM at 1 row, 1.02-1.21x
# at 2; at 4 and 8 rows 0.84-1.11x from run to run, and level in the engine at 4 sequences
SMALL_ROWS = 2

_Key = tuple[int, tuple[int, ...], tuple[int, ...]]
# weight (by storage, shape and strides) -> (its version counter when packed, the packed copy)
_packed: dict[_Key, tuple[int, torch.Tensor]] = {}


def supported(weight: torch.Tensor) -> bool:
    """A 2-d weight on a CPU where oneDNN's packed layout beats a plain `F.linear`: bf16 where
    oneDNN has bf16 instructions (AVX512-BF16 or AMX; SmolLM2-135M's 30 layers, 2 Xeon cores
    with AMX: 26.1 ms plain against 20.6 packed at 16 rows, 35.5 against 27.5 at 64), fp32
    where `packs_fp32` (on a Xeon fp32 gained nothing: MKL's GEMM is as fast there)."""
    return (
        ENABLED
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and (
            (
                weight.dtype == torch.bfloat16
                and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
            )
            or (weight.dtype == torch.float32 and packs_fp32())
        )
    )


@functools.cache
def packs_fp32(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether fp32 weights are packed too: on AMD CPUs, where `F.linear` runs MKL's GEMM off
    its Intel fast paths (SmolLM2-135M's 30 layers on 2 AMD EPYC Zen 5 cores: 28.2 ms plain
    against 9.3 packed at 16 rows, 97.7 against 30.0 at 64, 6.3 against 4.3 at 1)."""
    try:
        return "AuthenticAMD" in cpuinfo.read_text()
    except OSError:
        return False


def pack(weight: torch.Tensor) -> bool:
    """Pack `weight` [out, in] for `linear` where `supported`; whether it was. The packed copy
    lives while the weight does, beside it, so a model's bf16 weights are twice in memory (a
    data-less stand-in in the weight's place, as vLLM's CPU path leaves, ran the compiled
    decode slower: 287 against 393 tok/s at 16 sequences); it is made again if the weight is
    written in place."""
    if not supported(weight):
        return False
    key = _key(weight)
    if cpu_build.available():  # the C++ op keeps the table
        # a row of the weight's dtype stands for the steps' rows
        small = SMALL_ROWS if small_linear.supports(weight[:1], weight, SMALL_ROWS) else 0
        with torch.no_grad():
            torch.ops.deepinfer.packed_linear_pack(weight.detach(), PACK_ROWS, small)
        ptr, (n, k), (s0, s1) = key
        weakref.finalize(weight, torch.ops.deepinfer.packed_linear_forget, ptr, n, k, s0, s1)
        return True
    _python_op()
    _packed[key] = (weight._version, _reorder(weight))
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


def _lookup(weight: torch.Tensor) -> torch.Tensor | None:
    key = _key(weight)
    entry = _packed.get(key)
    if entry is None:
        return None
    version, packed = entry
    if version != weight._version:  # written since it was packed
        packed = _reorder(weight)
        _packed[key] = (weight._version, packed)
    return packed


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
    packed = _lookup(weight)
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("deepinfer::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
