"""The C++ sampler (kernels/sampling_cpu.py) against its torch reference at the same uniform
draws, and `sample` with it and with the torch path it replaces on CPU: the same supports and
the same distributions; the C++ greedy rows against torch's max (ties, NaN, strides)."""

from __future__ import annotations

import pytest
import torch

from daemon.loop.request import SamplingParams
from daemon.loop.sampler import SamplingBatch, greedy, sample
from kernels import sampling_cpu
from kernels.sampling_cpu import row_weights, sample_rows, sample_rows_reference

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_kernel_draws_the_reference_token(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 120
    logits = 4 * torch.randn(rows, vocab, generator=g)
    logits[::7, : vocab // 2] = float("-inf")  # banned tokens (logit bias) weigh nothing
    pick = torch.rand(4, rows, generator=g)
    top_k = torch.where(pick[0] < 0.5, torch.randint(1, 300, (rows,), generator=g), vocab)
    top_p = torch.where(pick[1] < 0.5, torch.rand(rows, generator=g), torch.ones(rows))
    min_p = torch.where(pick[2] < 0.3, 0.2 * torch.rand(rows, generator=g), torch.zeros(rows))
    temperature = 0.3 + torch.rand(rows, generator=g)
    u = torch.rand(rows, generator=g)
    weights = row_weights(logits, temperature)
    got = sample_rows(weights, top_k.clamp(max=vocab), top_p, min_p, u)
    want = sample_rows_reference(weights, top_k.clamp(max=vocab), top_p, min_p, u)
    assert torch.equal(got, want)
    assert bool((weights.gather(1, got[:, None]) > 0).all())


def test_extreme_draws_stay_in_the_support() -> None:
    weights = row_weights(PROBS.log().expand(4, -1).contiguous(), torch.ones(4))
    top_k, top_p = torch.tensor([4, 2, 4, 4]), torch.tensor([1.0, 1.0, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.5])
    for u in (0.0, 1.0 - 1e-7):
        tokens = sample_rows(weights, top_k, top_p, min_p, torch.full((4,), u))
        assert tokens.tolist() == ([0, 0, 0, 0] if u == 0.0 else [3, 1, 1, 1])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_both_paths_sample_the_same_distribution(
    monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    monkeypatch.setattr(sampling_cpu, "ENABLED", kernel)
    n = 20000
    cases = [
        (SamplingParams(), PROBS),
        (SamplingParams(temperature=2.0), PROBS.sqrt() / PROBS.sqrt().sum()),
        (SamplingParams(top_k=2), torch.tensor([0.625, 0.375, 0, 0])),
        (SamplingParams(top_p=0.81), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95),
        (SamplingParams(min_p=0.5), torch.tensor([0.625, 0.375, 0, 0])),
    ]
    for params, want in cases:
        rows = PROBS.log().expand(n, -1).clone()
        sb = SamplingBatch.build([params] * n, list(range(n)), 4)
        tokens = sample(rows, sb, torch.Generator().manual_seed(0)).tokens
        counts = torch.bincount(tokens, minlength=4).float() / n
        assert torch.allclose(counts, want, atol=0.015), (params, counts)
        assert set(tokens.tolist()) == {i for i in range(4) if want[i] > 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(64, 49152), (3, 17), (2, 15), (5, 1000)])
def test_greedy_rows_is_torchs_max(dtype: torch.dtype, rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    # ties: the first of equal maxima wins, across vector lanes and in the tail
    logits[0, vocab // 3] = logits[0, vocab - 1] = logits[0, 5] = 100.0
    logits[-1, vocab - 1] = logits[-1, vocab - 2] = 50.0
    want = logits.max(dim=-1).indices
    assert torch.equal(sampling_cpu.greedy_rows(logits), want)
    assert int(sampling_cpu.greedy_rows(logits)[0]) == 5
    assert torch.equal(greedy(logits), want)  # the sampler takes the op


def test_greedy_rows_takes_strided_rows_and_passes_nans_over() -> None:
    logits = torch.randn(8, 2 * 300)
    rows = logits[::2, :300]  # rows 2 apart, a row stride of 600
    assert torch.equal(sampling_cpu.greedy_rows(rows), rows.max(dim=-1).indices)
    cols = torch.randn(300, 4).t()  # not contiguous within a row
    assert torch.equal(sampling_cpu.greedy_rows(cols), cols.max(dim=-1).indices)
    nan = torch.tensor([[0.0, float("nan"), 3.0, 1.0] * 8])
    assert sampling_cpu.greedy_rows(nan).tolist() == [2]
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        sampling_cpu.greedy_rows(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"\[S, V\]"):
        sampling_cpu.greedy_rows(torch.zeros(3))
