"""The online correction of the step-cost table: the table as is until steps are measured, the
intercept from decode-only steps, the slope once verify steps measure it, old steps forgotten,
and the adaptive policy drafting less once the measured cost of a draft is higher."""

from __future__ import annotations

import random

from daemon.loop.spec.base import Candidate
from daemon.loop.spec.cost import CostRow, CostTable
from daemon.loop.spec.online_cost import MeasuredCost
from daemon.loop.spec.policy import AdaptivePolicy, build_policy


def table() -> CostTable:
    # 64 sequences: 0.115 s for their decodes, 0.83 ms per token beyond (a busy machine's profile)
    return CostTable([CostRow(64, [64, 128, 384], [0.115, 0.168, 0.381])], 1e-6)


def true_seconds(num_tokens: int) -> float:
    # what the steps take: 97 ms of decodes, 1.08 ms per token beyond
    return 0.097 + 1.08e-3 * (num_tokens - 64)


def test_unobserved_is_the_table() -> None:
    cost = MeasuredCost(table())
    for tokens in (64, 70, 128, 300):
        assert cost.seconds(tokens, 64) == table().seconds(tokens, 64)
    assert cost.rollback_seconds == 1e-6 and cost.corrections() == []


def test_decode_steps_move_the_intercept_not_the_slope() -> None:
    cost = MeasuredCost(table())
    for _ in range(200):
        cost.observe(64, 64, true_seconds(64))
    assert abs(cost.seconds(64, 64) - 0.097) < 1e-3
    slope = (cost.seconds(128, 64) - cost.seconds(64, 64)) / 64
    assert abs(slope - 0.83e-3) < 0.02e-3  # the table's: no step measured it
    assert cost.seconds(100, 100) < table().seconds(100, 100)  # the same bucket (64..127)
    assert cost.seconds(60, 60) == table().seconds(60, 60)  # another bucket: untouched


def test_verify_steps_teach_the_slope() -> None:
    cost = MeasuredCost(table())
    rng = random.Random(0)
    for _ in range(300):
        tokens = 64 + rng.choice([0, 0, 0, 4, 8, 16, 24])
        cost.observe(tokens, 64, true_seconds(tokens) * rng.uniform(0.97, 1.03))
    for tokens in (64, 72, 88):
        assert abs(cost.seconds(tokens, 64) - true_seconds(tokens)) < 0.004
    (fit,) = cost.corrections()
    assert fit["min_seqs"] == 64 and fit["max_seqs"] == 127
    assert fit["slope_s_per_token"] > 0  # steeper than the table


def test_old_steps_are_forgotten() -> None:
    cost = MeasuredCost(table())
    for _ in range(300):
        cost.observe(64, 64, 0.2)
    for _ in range(300):
        cost.observe(64, 64, 0.1)
    assert abs(cost.seconds(64, 64) - 0.1) < 2e-3


def test_steps_that_cannot_be_steps_are_ignored() -> None:
    cost = MeasuredCost(table())
    cost.observe(10, 64, 0.1)  # fewer rows than sequences
    cost.observe(64, 0, 0.1)
    cost.observe(64, 64, 0.0)
    assert cost.corrections() == []


def test_policy_drafts_less_once_drafts_are_measured_dear() -> None:
    policy = build_policy("adaptive", 5, table())
    assert isinstance(policy, AdaptivePolicy) and isinstance(policy.cost, MeasuredCost)
    # survivals of 0.6: worth it at the table's 0.83 ms a token against 1.8 ms a decode
    candidates = [Candidate(f"r{i}", [0.6] * 5, 5) for i in range(8)]
    before = sum(policy.choose(candidates, 64, 64))
    assert before > 0
    rng = random.Random(1)
    for _ in range(300):
        tokens = 64 + rng.choice([0, 0, 8, 16])
        policy.observe_step(tokens, 64, true_seconds(tokens))
    # measured: 1.08 ms a token against 1.5 ms a decode: a 0.6 survival does not pay
    assert sum(policy.choose(candidates, 64, 64)) == 0
