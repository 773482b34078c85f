"""y = x W^T for up to 8 bf16 rows on a CPU with AVX-512 (C++, csrc/small_linear.cpp; dpbf16 where
the CPU has AVX512-BF16) as the torch op `deepinfer::small_linear`: decode at low concurrency
reads each weight once, in place, 1.04-1.18x faster than oneDNN's packed GEMM at 1-2 rows on Zen 5
(reference: `F.linear`)."""

from __future__ import annotations

import os

import torch

from kernels import cpu_build

# DEEPINFER_CPU_KERNELS=0: `supports` says no (read once, at import)
ENABLED = os.environ.get("DEEPINFER_CPU_KERNELS", "1") != "0"
MAX_ROWS = 8  # the most rows of x the op takes


def supports(rows: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether the op serves `rows` [M, K] x `weight` [N, K]: bf16 both, the weight stored
    row-major, on a CPU with AVX-512, 1 <= M <= `max_rows`, the kernels built."""
    return (
        ENABLED
        and rows.dim() == 2
        and 1 <= rows.shape[0] <= min(max_rows, MAX_ROWS)
        and rows.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and rows.device.type == "cpu"
        and cpu_build.has_avx512()
        and cpu_build.available()
    )


def small_linear(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(rows, weight, bias)` for [M, K] rows, M <= MAX_ROWS (see `supports`)."""
    return torch.ops.deepinfer.small_linear(rows, weight, bias)


torch.library.define("deepinfer::small_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


@torch.library.register_fake("deepinfer::small_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
