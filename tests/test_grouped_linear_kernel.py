"""The Triton grouped linear (MoE experts, host-sync free) against its torch reference, in
float32 and float16 (Triton's interpreter on a CPU: its bf16 arithmetic is not exact)."""

from __future__ import annotations

import pytest
import torch

from kernels.grouped_linear import grouped_linear_reference, grouped_linear_triton

# CUDA runs the compiled kernels; elsewhere Triton's interpreter runs them (tests/__init__.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routed(counts: list[int], in_features: int, out_features: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(sum(counts) + in_features)
    x = torch.randn(sum(counts), in_features, generator=gen).to(dtype)
    weight = torch.randn(len(counts), out_features, in_features, generator=gen).to(dtype)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, weight, ends


@pytest.mark.parametrize(
    "counts,in_features,out_features",
    [
        ([3, 0, 17, 1], 32, 64),  # an empty group, a group over two row blocks
        ([0, 0, 5], 48, 80),  # widths that are not multiples of the blocks
        ([40], 64, 16),
        ([1, 1, 1, 1, 1, 1, 1, 1], 16, 130),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_linear_matches_reference(counts, in_features, out_features, dtype) -> None:
    x, weight, ends = _routed(counts, in_features, out_features, dtype)
    got = grouped_linear_triton(x.to(DEVICE), weight.to(DEVICE), ends.to(DEVICE)).cpu()
    want = grouped_linear_reference(x.float(), weight.float(), ends)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol * in_features**0.5, rtol=tol)


def test_grouped_linear_strided_weight_and_int64_ends() -> None:
    """Expert weights stored column-major (as the MoE keeps them), ends as int64."""
    x, weight, ends = _routed([4, 9, 2], 32, 48, torch.float32)
    column_major = weight.transpose(1, 2).contiguous().transpose(1, 2)
    got = grouped_linear_triton(x.to(DEVICE), column_major.to(DEVICE), ends.long().to(DEVICE)).cpu()
    torch.testing.assert_close(got, grouped_linear_reference(x, weight, ends), atol=1e-4, rtol=1e-5)


def test_no_rows() -> None:
    x, weight, ends = _routed([0, 0], 16, 16, torch.float32)
    assert grouped_linear_triton(x.to(DEVICE), weight.to(DEVICE), ends.to(DEVICE)).shape == (0, 16)
