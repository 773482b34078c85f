"""`deepinfer::small_linear` (a few bf16 rows times a weight read in place, csrc/small_linear.cpp)
against `F.linear` in fp32, and `packed_linear` handing it the rows it serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import packed_linear, small_linear

BF16 = torch.bfloat16
needs_avx512 = pytest.mark.skipif(
    not small_linear.supports(torch.empty(1, 1, dtype=BF16), torch.empty(1, 1, dtype=BF16)),
    reason="this CPU has no AVX-512 (or DEEPINFER_CPU_KERNELS=0, or no C++ compiler)",
)


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(BF16)
    return x, w, torch.randn(n, generator=g).to(BF16)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def within_a_rounding(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 output of fp32 sums: one bf16 rounding of the exact value, plus the sums' order."""
    assert ours.dtype == BF16 and ours.shape == ref.shape
    err = (ours.float() - ref).abs()
    assert bool((err <= 2**-8 * ref.abs() + 1e-3).all()), float(err.max())


@needs_avx512
@pytest.mark.parametrize("m", range(1, small_linear.MAX_ROWS + 1))
@pytest.mark.parametrize(
    ("n", "k"),
    [(960, 576), (576, 1536), (37, 50), (5, 32), (3, 7), (70, 1000)],
    ids=["qkv", "down", "odd", "one-chunk", "tail-only", "long-tail"],
)
def test_matches_fp32_linear(m: int, n: int, k: int) -> None:
    """Every row count the op takes, weight rows not a multiple of its blocks (the last ones one
    at a time) and K not a multiple of 32 (the masked tail)."""
    x, w, b = operands(m, n, k, seed=m * 1000 + n + k)
    within_a_rounding(small_linear.small_linear(x, w), reference(x, w, None))
    within_a_rounding(small_linear.small_linear(x, w, b), reference(x, w, b))


@needs_avx512
def test_strided_inputs_are_read_as_their_values() -> None:
    x, w, _ = operands(2, 64, 96, seed=3)
    xt = x.t().contiguous().t()  # column-major rows
    assert not xt.is_contiguous()
    within_a_rounding(small_linear.small_linear(xt, w), reference(x, w, None))


def test_bad_operands_are_refused() -> None:
    x, w, _ = operands(2, 8, 32, seed=1)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        small_linear.small_linear(torch.zeros(9, 32, dtype=BF16), w)
    with pytest.raises(RuntimeError, match="disagree on K"):
        small_linear.small_linear(x[:, :16], w)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        small_linear.small_linear(x.float(), w.float())


def test_supports_only_what_it_serves() -> None:
    x, w, _ = operands(2, 8, 32, seed=1)
    assert not small_linear.supports(x.float(), w)
    assert not small_linear.supports(torch.zeros(9, 32, dtype=BF16), w)
    assert not small_linear.supports(x, w, max_rows=1)
    assert not small_linear.supports(x, w.t().contiguous().t()[:, :32])  # a strided weight


@needs_avx512
@pytest.mark.parametrize(
    "how",
    [
        packed_linear.Plan(small_rows=packed_linear.SMALL_ROWS),
        packed_linear.Plan(widen=True, small_rows=small_linear.MAX_ROWS),
    ],
    ids=["bf16-packed", "fp32-packed"],
)
def test_packed_linear_hands_it_a_few_rows_and_onednn_the_rest(how: packed_linear.Plan) -> None:
    """Up to the plan's small rows are read from the plain weight (small_linear), more from
    oneDNN's packed copy (bf16, or widened to fp32 where the CPU has no bf16 arithmetic): a
    write through `.data` (which does not count as a write, so nothing is packed again) shows
    in the first only. The kernels otherwise often agree bitwise."""
    w, b = operands(1, 300, 576, seed=5)[1:]
    assert packed_linear.pack(w, how)
    before = w.clone()
    w.data.mul_(-1)
    with torch.inference_mode():
        for m in (1, how.small_rows, how.small_rows + 1, 16):
            x = operands(m, 300, 576, seed=m)[0]
            out = packed_linear.linear(x.view(1, m, 576), w, b).view(m, 300)
            read = w if m <= how.small_rows else before
            within_a_rounding(out, reference(x, read, b))
