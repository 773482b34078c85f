"""The batched sampler: masks, penalties, seeds and the sampled distribution."""

from __future__ import annotations

import math

import torch

from daemon.loop.request import SamplingParams
from daemon.loop.sampler import (
    PenaltyState,
    SamplingBatch,
    apply_logit_bias,
    apply_penalties,
    sample,
    target_logprobs,
)

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draw(params: SamplingParams, n: int = 400, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    rows = logits.expand(n, -1).clone()
    sb = SamplingBatch.build([params] * n, list(range(n)), logits.shape[-1])
    return sample(rows, sb, torch.Generator().manual_seed(0)).tokens


def test_greedy_rows_take_the_argmax() -> None:
    assert set(draw(SamplingParams(temperature=0.0)).tolist()) == {0}
    assert set(draw(SamplingParams(top_k=1)).tolist()) == {0}


def test_top_k_top_p_min_p_limit_the_support() -> None:
    assert set(draw(SamplingParams(top_k=2)).tolist()) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.8)).tolist()) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.81)).tolist()) == {0, 1, 2}
    assert set(draw(SamplingParams(min_p=0.2)).tolist()) == {0, 1, 2}
    assert set(draw(SamplingParams(top_p=0.3)).tolist()) == {0}


def test_samples_follow_the_distribution() -> None:
    n = 20000
    counts = torch.bincount(draw(SamplingParams(), n), minlength=4).float() / n
    assert torch.allclose(counts, PROBS, atol=0.015), counts
    # temperature 2 flattens: p_i ∝ sqrt(p_i)
    flat = PROBS.sqrt() / PROBS.sqrt().sum()
    counts = torch.bincount(draw(SamplingParams(temperature=2.0), n), minlength=4).float() / n
    assert torch.allclose(counts, flat, atol=0.015), counts


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    vocab = 1000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=42)
    params = [SamplingParams(temperature=1.0)] * 5 + [seeded]
    batch = sample(
        logits.clone(), SamplingBatch.build(params, [0] * 5 + [7], vocab), torch.Generator()
    )
    alone = sample(logits[5:].clone(), SamplingBatch.build([seeded], [7], vocab), torch.Generator())
    assert batch.tokens[5] == alone.tokens[0]
    draws = {
        sample(
            logits[5:].clone(), SamplingBatch.build([seeded], [i], vocab), torch.Generator()
        ).tokens.item()
        for i in range(20)
    }
    assert len(draws) > 1  # the output position moves the stream


def test_penalties_match_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    state = PenaltyState.create(
        prompt_ids=[0], output_ids=[1, 3, 3], vocab=5, device=torch.device("cpu")
    )
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [0], [state], [p])
    expected = [
        2.0 / 2,  # prompt token, positive: divided
        -1.0 * 2 - 0.5 * 1 - 0.25,  # output once, negative: multiplied
        0.5,  # unseen
        3.0 / 2 - 0.5 * 2 - 0.25,  # output twice
        -2.0,
    ]
    assert torch.allclose(logits[0], torch.tensor(expected)), logits
    assert math.isclose(float(state.output_counts[3]), 2)


def test_logit_bias_forces_and_bans() -> None:
    logits = LOGITS.expand(2, -1).clone()
    rows, ids, bias = torch.tensor([0, 1]), torch.tensor([3, 0]), torch.tensor([100.0, -100.0])
    apply_logit_bias(logits, rows, ids, bias)
    sb = SamplingBatch.build([SamplingParams(temperature=0.0)] * 2, [0, 0], 4)
    assert sample(logits, sb, None).tokens.tolist() == [3, 1]  # forced; the argmax banned


def test_target_logprobs_rank_and_top() -> None:
    out = target_logprobs(LOGITS.expand(2, -1).clone(), torch.tensor([2, 0]), 2)
    assert torch.allclose(out.logprob, PROBS[[2, 0]].log())
    assert out.rank.tolist() == [3, 1]
    assert out.top_ids.tolist() == [[0, 1], [0, 1]]
    assert target_logprobs(LOGITS[None], torch.tensor([1]), 0).top_ids is None


def test_a_top_k_past_int64_keeps_every_token() -> None:
    """A client's top_k of 2**63 (valid JSON, accepted as "no limit") once failed the whole
    engine loop (the tensor of k overflowed)."""
    sb = SamplingBatch.build([SamplingParams(top_k=2**63), SamplingParams(top_k=2)], [0, 1], 4)
    assert sb.top_k.tolist() == [4, 2] and sb.needs_top_k
