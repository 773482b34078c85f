"""The online correction of the step-cost table: the table as is until steps are measured, the
intercept from decode-only steps, the slope once verify steps measure it, no jump in the price
of a step between batch sizes on either side of a power of two (what sitting out saves), steps
with prefill chunks fitted apart (their drafts' slope recovered though the chunks shrink as
drafts grow), steps priced at their context, old steps forgotten, the adaptive policy drafting less once the measured cost of
a draft is higher, with chunks in every step or none, a level error of the table (every step
dearer than profiled) kept off the drafts' price where the budget stays near its mean, a
step that verifies at all charged its own cost beside each draft row's, and one step far
above its price (the machine busy elsewhere) not taken at its word."""

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
        assert cost.seconds(tokens, 64, tokens - 64) == table().seconds(tokens, 64)
        assert cost.seconds(tokens, 64) == table().seconds(tokens, 64)
    assert cost.rollback_seconds == 1e-6 and cost.corrections() == []


def test_decode_steps_move_the_intercept_not_the_slope() -> None:
    cost = MeasuredCost(table())
    for _ in range(200):
        cost.observe(64, 64, 0, true_seconds(64))
    assert abs(cost.seconds(64, 64) - 0.097) < 1e-3
    slope = (cost.seconds(128, 64, 64) - cost.seconds(64, 64)) / 64
    assert abs(slope - 0.83e-3) < 0.02e-3  # the table's: no step measured it
    assert cost.seconds(32, 32) == table().seconds(32, 32)  # an anchor no step taught
    assert cost.seconds(0, 0) == table().seconds(0, 0)  # no sequence: no anchor
    # between anchors, a blend of their corrections by nearness (none at the untaught one)
    for seqs in (48, 60, 100):
        share = 1 - abs(seqs - 64) / (32 if seqs < 64 else 64)
        corrected = table().seconds(seqs, seqs) + share * (cost.seconds(64, 64) - 0.115)
        assert abs(cost.seconds(seqs, seqs) - corrected) < 1e-9
    assert cost.seconds(96, 64) == table().seconds(96, 64)  # a step with a chunk: untouched


def test_steps_at_their_context_are_priced_by_the_tables_context_term() -> None:
    """Steps whose rows read more positions than the profile's, as long as its context term
    says, leave no correction: their drafts are priced at their context, dearer."""
    t = CostTable(table().rows, 1e-6, context=128, context_seconds=2e-6)
    cost = MeasuredCost(t)
    for drafts in (0, 8, 0, 16) * 20:
        cost.observe(64 + drafts, 64, drafts, t.seconds(64 + drafts, 64, drafts, 400), 400)
    for drafts in (0, 8, 32):
        at = t.seconds(64 + drafts, 64, drafts, 400)
        assert abs(cost.seconds(64 + drafts, 64, drafts, 400) - at) < 1e-4
    draft_row = (cost.seconds(72, 64, 8, 400) - cost.seconds(64, 64, 0, 400)) / 8
    assert draft_row > (t.seconds(72, 64) - t.seconds(64, 64)) / 8 + 272 * 2e-6 * 0.9


def test_verify_steps_teach_the_slope() -> None:
    cost = MeasuredCost(table())
    rng = random.Random(0)
    for _ in range(300):
        tokens = 64 + rng.choice([0, 0, 0, 4, 8, 16, 24])
        cost.observe(tokens, 64, tokens - 64, true_seconds(tokens) * rng.uniform(0.97, 1.03))
    for tokens in (64, 72, 88):
        assert abs(cost.seconds(tokens, 64, tokens - 64) - true_seconds(tokens)) < 0.004
    (fit,) = cost.corrections()
    assert fit["seqs"] == 64 and not fit["chunks"]
    assert fit["slope_s_per_token"] > 0  # steeper than the table


def test_old_steps_are_forgotten() -> None:
    cost = MeasuredCost(table())
    for _ in range(300):
        cost.observe(64, 64, 0, 0.2)
    for _ in range(300):
        cost.observe(64, 64, 0, 0.1)
    assert abs(cost.seconds(64, 64) - 0.1) < 2e-3


def test_steps_that_cannot_be_steps_are_ignored() -> None:
    cost = MeasuredCost(table())
    cost.observe(10, 64, 0, 0.1)  # fewer rows than sequences
    cost.observe(64, 0, 0, 0.1)
    cost.observe(64, 64, 0, 0.0)
    cost.observe(70, 64, 7, 0.1)  # more drafts than rows beyond the sequences
    cost.observe(70, 64, -1, 0.1)
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
        policy.observe_step(tokens, 64, tokens - 64, true_seconds(tokens))
    # measured: 1.08 ms a token against 1.5 ms a decode: a 0.6 survival does not pay
    assert sum(policy.choose(candidates, 64, 64)) == 0


def mixed_seconds(drafts: int, chunk: int) -> float:
    # steps with a chunk: 97 ms of decodes plus 4 ms of the eager path, 1.08 ms per draft row,
    # and chunk tokens at 0.7 ms, cheaper than the table's 0.83 ms
    return 0.101 + 1.08e-3 * drafts + 0.7e-3 * chunk


def mixed_steps(n: int, seed: int) -> list[tuple[int, int]]:
    """(drafts, chunk tokens) of steps over 64 sequences as admission makes them: a chunk fills
    the budget, drafts take what a prompt's last chunk leaves."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            out.append((0, rng.randint(200, 448)))
        else:
            out.append((rng.choice([4, 8, 16, 24]), rng.randint(8, 96)))
    return out


def test_mixed_steps_teach_their_own_slope() -> None:
    cost = MeasuredCost(table())
    rng = random.Random(2)
    for drafts, chunk in mixed_steps(400, 3):
        seconds = mixed_seconds(drafts, chunk) * rng.uniform(0.98, 1.02)
        cost.observe(64 + drafts + chunk, 64, drafts, seconds)
    for drafts, chunk in ((0, 300), (0, 16), (8, 16), (24, 64)):
        tokens = 64 + chunk + drafts
        assert abs(cost.seconds(tokens, 64, drafts) - mixed_seconds(drafts, chunk)) < 0.003
    for chunk in (16, 64, 300):
        slope = (cost.seconds(64 + chunk + 16, 64, 16) - cost.seconds(64 + chunk, 64)) / 16
        # the drafts' slope, not the chunks' (their tokens fall as drafts rise)
        assert abs(slope - 1.08e-3) < 0.08e-3
    (fit,) = cost.corrections()
    assert fit["chunks"] and fit["seqs"] == 64
    # chunk-free steps keep the table until they are measured
    assert cost.seconds(80, 64, 16) == table().seconds(80, 64)


def test_policy_drafts_less_once_mixed_drafts_are_measured_dear() -> None:
    policy = build_policy("adaptive", 5, table())
    assert isinstance(policy, AdaptivePolicy)
    # a 32-token chunk in the step; survivals of 0.55: worth it at the table's 0.83 ms a draft
    # against 1.8 ms a sequence's share of a decode step (the chunk's time is not the drafts')
    candidates = [Candidate(f"r{i}", [0.55] * 5, 5) for i in range(8)]
    assert sum(policy.choose(candidates, 64, 64 + 32)) > 0
    for drafts, chunk in mixed_steps(300, 4):
        policy.observe_step(64 + drafts + chunk, 64, drafts, mixed_seconds(drafts, chunk))
    # measured: 1.08 ms a draft against 1.8 ms a share: a 0.55 survival does not pay
    assert sum(policy.choose(candidates, 64, 64 + 32)) == 0


def level_seconds(drafts: int, chunk: int) -> float:
    # contexts longer than the profile's (or a busier machine): the decodes take 25 ms more
    # than the table's 115 ms, a draft row 1.2 ms (the table: 0.83), a chunk token 0.7 ms
    return 0.140 + 1.2e-3 * drafts + 0.7e-3 * chunk


def draft_price(cost: MeasuredCost, chunk: int, drafts: int) -> float:
    """Seconds a draft row adds, on average over the first `drafts`, to a step with `chunk`."""
    base = 64 + chunk
    return (cost.seconds(base + drafts, 64, drafts) - cost.seconds(base, 64)) / drafts


def test_a_level_error_is_not_charged_to_drafts() -> None:
    # the adaptive budget keeps near its mean (30-50 drafts a step, none without): a fit that
    # cannot tell the level from the slope must not put the table's level error on the drafts
    cost = MeasuredCost(table())
    rng = random.Random(5)
    for _ in range(400):
        drafts = rng.randint(30, 50)
        cost.observe(64 + drafts, 64, drafts, level_seconds(drafts, 0) * rng.uniform(0.99, 1.01))
    for drafts in (8, 40):
        assert abs(draft_price(cost, 0, drafts) - 1.2e-3) < 0.05 * 1.2e-3
    assert abs(cost.seconds(104, 64, 40) - level_seconds(40, 0)) < 0.002


def test_a_level_error_is_not_charged_to_drafts_beside_chunks() -> None:
    cost = MeasuredCost(table())
    rng = random.Random(6)
    for _ in range(400):
        drafts, chunk = rng.randint(0, 16), rng.randint(150, 450)
        seconds = level_seconds(drafts, chunk) * rng.uniform(0.995, 1.005)
        cost.observe(64 + drafts + chunk, 64, drafts, seconds)
    for chunk, drafts in ((300, 8), (200, 16)):
        assert abs(draft_price(cost, chunk, drafts) - 1.2e-3) < 0.05 * 1.2e-3


def test_policy_drafts_what_pays_at_the_measured_price() -> None:
    policy = build_policy("adaptive", 5, table())
    assert isinstance(policy, AdaptivePolicy)
    rng = random.Random(7)
    for _ in range(400):
        drafts = rng.randint(30, 50)
        policy.observe_step(64 + drafts, 64, drafts, level_seconds(drafts, 0))
    # a 64-sequence decode step of 140 ms, 1.2 ms a draft row: a first slot pays from a
    # survival of 0.55; charged the level error too (1.56 ms a row), from 0.71
    candidates = [Candidate(f"r{i}", [0.65] * 5, 5) for i in range(8)]
    assert policy.choose(candidates, 64, 64) == [1] * 8


def sit_out_table() -> CostTable:
    # profiled at 16 and 64 sequences, as the start-up profile does: 60 ms + 0.5 ms a sequence
    # for the decodes, 1.6 ms a draft row
    return CostTable(
        [
            CostRow(16, [16, 32], [0.068, 0.068 + 16 * 1.6e-3]),
            CostRow(64, [64, 128], [0.092, 0.092 + 64 * 1.6e-3]),
        ]
    )


def sit_out_seconds(seqs: int, drafts: int = 0) -> float:
    # what the steps take: 45 ms fixed, 1.07 ms a sequence (steeper than the table between its
    # rows), 1.6 ms a draft row
    return 0.045 + 1.07e-3 * seqs + 1.6e-3 * drafts


def sit_out_steps(n: int, seed: int) -> list[tuple[int, int]]:
    """(sequences, drafts) of steps at concurrency 32 under overlap: half of them all 32, the
    rest with some sitting out or finished (17..31), a few verifying."""
    rng = random.Random(seed)
    return [
        (32 if rng.random() < 0.5 else rng.randint(17, 31), rng.choice([0, 0, 0, 2, 4]))
        for _ in range(n)
    ]


def test_sitting_out_is_priced_without_a_jump_at_a_power_of_two() -> None:
    cost = MeasuredCost(sit_out_table())
    for seqs, drafts in sit_out_steps(600, 8):
        cost.observe(seqs + drafts, seqs, drafts, sit_out_seconds(seqs, drafts))
    for out in (1, 2, 4, 8):
        saved = cost.seconds(32, 32) - cost.seconds(32 - out, 32 - out)
        assert abs(saved / out - 1.07e-3) < 0.35 * 1.07e-3, (out, saved)
    for seqs in range(17, 40):  # no step between neighbours is far from the truth's 1.07 ms
        step = cost.seconds(seqs + 1, seqs + 1) - cost.seconds(seqs, seqs)
        assert 0 < step < 3 * 1.07e-3, (seqs, step)


def test_a_verify_that_costs_its_sequence_a_step_is_not_chosen_for_a_weak_draft() -> None:
    # under overlap a verifying sequence sits out the next step: a first draft surviving at 0.6
    # gains 0.6 tokens, loses the next step's token and saves only its 1.07 ms in that step
    policy = build_policy("adaptive", 5, sit_out_table(), overlap=True)
    assert isinstance(policy, AdaptivePolicy) and policy.hold
    for seqs, drafts in sit_out_steps(600, 9):
        policy.observe_step(seqs + drafts, seqs, drafts, sit_out_seconds(seqs, drafts))
    assert policy.choose([Candidate("weak", [0.6] * 5, 5)], 32, 32) == [0]
    assert policy.choose([Candidate("sure", [0.99] * 5, 5)], 32, 32) == [5]


def jump_table() -> CostTable:
    # profiled at 16 and 64 sequences: 47 and 90 ms of decodes, 0.8 ms a row beyond
    return CostTable(
        [
            CostRow(16, [16, 48], [0.047, 0.047 + 32 * 0.8e-3]),
            CostRow(64, [64, 128], [0.090, 0.090 + 64 * 0.8e-3]),
        ]
    )


def jump_seconds(drafts: int) -> float:
    # what steps of 32 sequences take (bench.spec_cost on SmolLM2, 2 Xeon cores with AMX): 59 ms
    # of decodes, 5 ms more for any verify (33 rows cost 5 ms more than 32; the verify's own
    # work), then 0.6 ms a draft row
    return 0.059 + (0.005 + 0.6e-3 * drafts if drafts else 0.0)


def test_a_step_that_verifies_is_charged_its_own_cost() -> None:
    policy = build_policy("adaptive", 5, jump_table())
    assert isinstance(policy, AdaptivePolicy) and isinstance(policy.cost, MeasuredCost)
    rng = random.Random(11)
    for _ in range(400):
        drafts = rng.choice([0, 0, 1, 2, 3, 6, 10])
        policy.observe_step(32 + drafts, 32, drafts, jump_seconds(drafts))
    cost = policy.cost
    first = cost.seconds(33, 32, 1) - cost.seconds(32, 32)
    assert abs(first - 5.6e-3) < 0.6e-3, first  # the fit without a verify cost: 0.96 ms
    (fit,) = cost.corrections()
    assert abs(fit["verify_s"] - 0.005) < 1e-3 and abs(fit["slope_s_per_token"]) < 0.3e-3
    # a decode token is worth 1.84 ms here: one draft of 0.9 does not pay for the verify,
    # eight of them together do (7.2 tokens for 9.8 ms)
    assert policy.choose([Candidate("one", [0.9] * 5, 1)], 32, 32) == [0]
    many = [Candidate(f"r{i}", [0.9] * 5, 1) for i in range(8)]
    assert policy.choose(many, 32, 32) == [1] * 8


def test_one_step_far_above_its_price_does_not_make_drafts_dear() -> None:
    """A verify step that took twice its price (the machine busy elsewhere) moves the fit as
    one 25 % off would: drafts that paid before it still pay, and the steps after it teach
    the price back."""
    policy = build_policy("adaptive", 5, table())
    assert isinstance(policy, AdaptivePolicy)
    candidates = [Candidate(f"r{i}", [0.97] * 5, 5) for i in range(64)]
    for _ in range(100):
        policy.observe_step(64, 64, 0, true_seconds(64))
    assert sum(policy.choose(candidates, 64, 64)) > 0
    policy.observe_step(175, 64, 111, 2 * true_seconds(175))
    assert sum(policy.choose(candidates, 64, 64)) > 0
    for _ in range(20):
        policy.observe_step(175, 64, 111, true_seconds(175))
    assert abs(policy.cost.seconds(175, 64, 111) - true_seconds(175)) < 0.01
