"""The verify-length policies (fixed, adaptive against a brute-force search), the online
calibrator and the step-cost table (interpolation, extrapolation, JSON)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from daemon.loop.spec.base import OVERLAP_MIN_SHARE, Candidate
from daemon.loop.spec.calibration import Calibrator
from daemon.loop.spec.cost import CostRow, CostTable
from daemon.loop.spec.policy import AdaptivePolicy, FixedPolicy, build_policy
from daemon.loop.spec.speculator import Speculator
from tests.spec_doubles import OracleDrafter


class TableCost:
    """A StepCost from an arbitrary per-total-tokens table (not even monotone)."""

    def __init__(self, by_tokens: dict[int, float]) -> None:
        self.by_tokens = by_tokens

    def seconds(
        self, num_tokens: int, num_seqs: int, num_drafts: int = 0, context: float | None = None
    ) -> float:
        return self.by_tokens[num_tokens]


class LinearCost:
    def __init__(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, per_token

    def seconds(
        self, num_tokens: int, num_seqs: int, num_drafts: int = 0, context: float | None = None
    ) -> float:
        return self.fixed + self.per_token * num_tokens


def rate(
    lengths: list[int],
    survivals: list[list[float]],
    cost,
    num_seqs: int,
    num_tokens: int,
    rollback: float = 0.0,
    hold: bool = False,
) -> float:
    """The adaptive policy's objective, written out: expected tokens over the step's decode
    seconds (a decode step of its sequences plus what the drafts add, the chunk's time left
    out); with `hold`, over this step and the next, which the non-verifying ones run alone
    where they are at least OVERLAP_MIN_SHARE of the sequences (else no next step runs)."""
    drafts = sum(lengths)
    gain = num_seqs + sum(sum(s[:n]) for s, n in zip(survivals, lengths))
    verifying = sum(n > 0 for n in lengths)
    base = cost.seconds(num_tokens, num_seqs)
    decode = cost.seconds(num_seqs, num_seqs)
    seconds = decode + max(cost.seconds(num_tokens + drafts, num_seqs, drafts) - base, 0.0)
    seconds += rollback * verifying
    if hold and 0 < verifying < num_seqs and num_seqs - verifying >= OVERLAP_MIN_SHARE * num_seqs:
        others = num_seqs - verifying
        gain += others
        seconds += cost.seconds(others, others)
    return gain / seconds


def survivals_of(policy: AdaptivePolicy, candidates: list[Candidate]) -> list[list[float]]:
    out = []
    for c in candidates:
        s, row = 1.0, []
        for conf in c.confidence[: min(policy.k, c.max_len)]:
            s *= policy.calibrator.calibrate(conf)
            row.append(s)
        out.append(row)
    return out


def random_case(rng: random.Random) -> tuple[int, int, list[Candidate], int, int]:
    """k, up to 3 candidates with drafts of 0..k+1 tokens, the step's sequences and tokens."""
    k, n = rng.randint(1, 4), rng.randint(1, 3)
    candidates = [
        Candidate(
            f"r{i}",
            [rng.random() ** rng.choice((0.3, 1, 3)) for _ in range(rng.randint(0, k + 1))],
            rng.randint(0, k + 1),
        )
        for i in range(n)
    ]
    num_seqs = n + rng.randint(0, 3)
    return k, n, candidates, num_seqs, num_seqs + rng.randint(0, 40)


# ---- adaptive policy ----------------------------------------------------------------------


def test_adaptive_matches_brute_force_over_all_length_vectors() -> None:
    rng = random.Random(0)
    for case in range(300):
        k, n, candidates, num_seqs, num_tokens = random_case(rng)
        cost = TableCost(
            {t: rng.uniform(0.5, 3.0) for t in range(num_tokens + n * k + 1)}
            if case % 2
            else {t: 1.0 + rng.uniform(0, 0.2) * t for t in range(num_tokens + n * k + 1)}
        )
        policy = AdaptivePolicy(k, cost, Calibrator())
        got = policy.choose(candidates, num_seqs, num_tokens)
        surv = survivals_of(policy, candidates)
        limits = [len(s) for s in surv]
        best = max(
            rate(list(v), surv, cost, num_seqs, num_tokens)
            for v in itertools.product(*(range(m + 1) for m in limits))
        )
        assert all(0 <= g <= m for g, m in zip(got, limits)), (case, got, limits)
        assert rate(got, surv, cost, num_seqs, num_tokens) == pytest.approx(best, rel=1e-12)
        assert policy.last_budget == sum(got)


def test_adaptive_with_a_held_step_is_near_the_brute_force_best() -> None:
    # a held step is priced per verifying candidate (a knapsack): the ranked scan is not
    # exact, but on step costs that grow with tokens it stays within 2 per cent
    rng = random.Random(3)
    ratios = []
    for case in range(600):
        k, n, candidates, num_seqs, num_tokens = random_case(rng)
        cost = LinearCost(rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.1))
        policy = AdaptivePolicy(k, cost, Calibrator(), hold=True)
        got = policy.choose(candidates, num_seqs, num_tokens)
        surv = survivals_of(policy, candidates)
        best = max(
            rate(list(v), surv, cost, num_seqs, num_tokens, hold=True)
            for v in itertools.product(*(range(len(s) + 1) for s in surv))
        )
        ours = rate(got, surv, cost, num_seqs, num_tokens, hold=True)
        assert ours >= rate([0] * n, surv, cost, num_seqs, num_tokens) - 1e-12, case
        ratios.append(ours / best)
    assert min(ratios) > 0.98 and sum(ratios) / len(ratios) > 0.999


def test_adaptive_verifies_nothing_when_tokens_cost_much() -> None:
    # a compute-bound large batch: every extra token adds ~1/num_tokens of the step
    policy = AdaptivePolicy(5, LinearCost(0.0, 1e-3))
    candidates = [Candidate(f"r{i}", [0.9] * 5, 5) for i in range(64)]
    assert policy.choose(candidates, 64, 64) == [0] * 64
    assert policy.last_budget == 0


def test_adaptive_verifies_everything_when_drafts_are_sure_and_tokens_free() -> None:
    policy = AdaptivePolicy(5, LinearCost(0.01, 1e-9))
    candidates = [Candidate("a", [0.999] * 7, 7), Candidate("b", [1.0] * 3, 3)]
    assert policy.choose(candidates, 3, 10) == [5, 3]
    assert policy.last_budget == 8
    assert policy.last_expected == pytest.approx(0.999 * (1 - 0.999**5) / 0.001 + 3, rel=1e-6)


def test_adaptive_spends_the_budget_on_the_likelier_drafts() -> None:
    policy = AdaptivePolicy(4, LinearCost(1.0, 0.15))
    sure, unsure = Candidate("sure", [0.95] * 4, 4), Candidate("unsure", [0.2] * 4, 4)
    lengths = policy.choose([sure, unsure], 2, 2)
    assert lengths[0] > 0 and lengths[1] == 0


def test_adaptive_rollback_cost_holds_drafts_back() -> None:
    candidates = [Candidate(f"r{i}", [0.3], 1) for i in range(4)]
    cost = LinearCost(1.0, 0.01)
    assert AdaptivePolicy(3, cost).choose(candidates, 4, 4) == [1, 1, 1, 1]
    assert AdaptivePolicy(3, cost, rollback_seconds=0.2).choose(candidates, 4, 4) == [0] * 4


def test_adaptive_verifies_only_past_its_min_gain() -> None:
    """A plan with drafts is taken only where its expected rate beats none's by `min_gain`:
    here the best (every draft) makes (4 + 4 * 0.3) / 1.08 tokens a second against 4 / 1.04,
    25 % more."""
    candidates = [Candidate(f"r{i}", [0.3], 1) for i in range(4)]
    cost = LinearCost(1.0, 0.01)
    assert AdaptivePolicy(3, cost, min_gain=0.2).choose(candidates, 4, 4) == [1, 1, 1, 1]
    held = AdaptivePolicy(3, cost, min_gain=0.3)
    assert held.choose(candidates, 4, 4) == [0] * 4
    assert held.last_budget == 0 and held.last_expected == 0.0
    with pytest.raises(ValueError, match="min_gain"):
        AdaptivePolicy(3, cost, min_gain=-0.1)


def test_adaptive_under_overlap_pays_for_the_held_step() -> None:
    # drafts expected to give 0.8 tokens: worth a nearly free verify, but under overlap not
    # the step the sequence then sits out while another decodes; alone, it sits out nothing
    cost = LinearCost(1.0, 1e-3)
    candidate = [Candidate("r", [0.5, 0.6], 2)]
    assert AdaptivePolicy(2, cost).choose(candidate, 2, 2) == [2]
    assert AdaptivePolicy(2, cost, hold=True).choose(candidate, 2, 2) == [0]
    assert AdaptivePolicy(2, cost, hold=True).choose(candidate, 1, 1) == [2]
    sure = [Candidate("r", [0.95, 0.95], 2)]  # 1.85 expected: worth the held step
    assert AdaptivePolicy(2, cost, hold=True).choose(sure, 2, 2) == [2]


def test_adaptive_prices_the_held_step_at_its_seconds() -> None:
    # compute-bound steps: the step the verifying sequence sits out is the others' decode
    # step, a quarter cheaper than one with it. Over both steps 2.88 expected drafts pay:
    # (4 + 2.88 + 3) / (0.5 + 0.3 + 0.4) = 8.23 tokens/s against 4 / 0.5 = 8 without. A flat
    # charge of the one token it forgoes, against this step alone, refused them:
    # (4 + 2.88 - 1) / 0.8 = 7.35
    sure = Candidate("r", [0.98] * 3, 3)
    policy = AdaptivePolicy(3, LinearCost(0.1, 0.1), hold=True)
    assert policy.choose([sure], 4, 4) == [3]
    assert policy.last_expected == pytest.approx(0.98 + 0.98**2 + 0.98**3)
    # where the others' step costs as much as one with it (host-bound), the held step costs
    # the token forgone: drafts must be expected to give more than 1
    host_bound = AdaptivePolicy(3, LinearCost(1.0, 0.0), hold=True)
    unsure = Candidate("r", [0.6, 0.5, 0.5], 3)  # 0.6 + 0.3 + 0.15 = 1.05 expected
    assert host_bound.choose([unsure], 4, 4) == [3]
    weak = Candidate("r", [0.6, 0.4, 0.4], 3)  # 0.6 + 0.24 + 0.096 = 0.936
    assert host_bound.choose([weak], 4, 4) == [0]


def test_adaptive_leaves_a_chunks_seconds_out() -> None:
    # a prefill chunk's seconds are spent whatever is drafted: beside a 1900-token chunk the
    # drafts of a compute-bound batch are as dear as without it, and refused as they are
    candidates = [Candidate(f"r{i}", [0.9] * 5, 5) for i in range(64)]
    compute_bound = AdaptivePolicy(5, LinearCost(0.0, 1e-3))
    assert compute_bound.choose(candidates, 64, 64 + 1900) == [0] * 64
    # on any cost linear in the tokens, a chunk changes nothing in the choice
    rng = random.Random(5)
    for _ in range(50):
        cost = LinearCost(rng.uniform(0.01, 1.0), rng.uniform(0.0, 0.05))
        policy = AdaptivePolicy(5, cost, hold=rng.random() < 0.5)
        some = [
            Candidate(f"r{i}", [rng.random() ** 0.3 for _ in range(5)], 5)
            for i in range(rng.randint(1, 8))
        ]
        seqs = len(some) + rng.randint(0, 4)
        assert policy.choose(some, seqs, seqs) == policy.choose(some, seqs, seqs + 1500)


def test_adaptive_follows_calibration() -> None:
    # raw 0.9 that is really accepted 5 % of the time stops paying once it is learned
    policy = AdaptivePolicy(3, LinearCost(1.0, 0.2))
    candidates = [Candidate("r", [0.9] * 3, 3)]
    assert policy.choose(candidates, 1, 1) == [3]
    rng = random.Random(1)
    for _ in range(400):
        accepted = 0
        while accepted < 3 and rng.random() < 0.05:
            accepted += 1
        policy.observe([0.9] * 3, 3, accepted)
    assert policy.choose(candidates, 1, 1) == [0]


def test_fixed_policy_verifies_k_or_what_there_is() -> None:
    policy = FixedPolicy(5)
    candidates = [Candidate("a", [0.1] * 7, 7), Candidate("b", [0.9] * 2, 2), Candidate("c", [], 0)]
    assert policy.choose(candidates, 8, 100) == [5, 2, 0]
    assert policy.last_budget == 7
    policy.observe([0.9, 0.9], 2, 1)
    assert sum(b.trials for b in policy.calibrator.table()) == 2


def test_build_policy() -> None:
    cost = CostTable([CostRow(1, [1, 8], [0.01, 0.02])], rollback_seconds=0.003)
    assert isinstance(build_policy("fixed", 5), FixedPolicy)
    adaptive = build_policy("adaptive", 5, cost)
    assert isinstance(adaptive, AdaptivePolicy)
    assert adaptive.rollback_seconds == 0.003 and adaptive.k == 5
    assert not adaptive.hold
    overlapped = build_policy("adaptive", 5, cost, overlap=True)
    assert isinstance(overlapped, AdaptivePolicy) and overlapped.hold
    assert adaptive.min_gain == 0.0
    hurdled = build_policy("adaptive", 5, cost, min_gain=0.15)
    assert isinstance(hurdled, AdaptivePolicy) and hurdled.min_gain == 0.15
    with pytest.raises(ValueError, match="cost"):
        build_policy("adaptive", 5)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        build_policy("dspark", 5, cost)


def test_the_speculator_prices_a_step_by_its_policys_cost() -> None:
    """What the engine's step trace logs beside the measured time: the adaptive policy's
    cost for the step's shape; a fixed policy prices nothing."""
    cost = LinearCost(0.01, 0.001)
    adaptive = Speculator(OracleDrafter({}, 2), AdaptivePolicy(4, cost), 4)
    assert adaptive.price(40, 8, 32, 300.0) == pytest.approx(0.05)
    assert Speculator(OracleDrafter({}, 2), FixedPolicy(4), 4).price(40, 8, 32) is None


# ---- calibrator ---------------------------------------------------------------------------


def test_calibrator_starts_at_the_raw_confidence() -> None:
    cal = Calibrator()
    assert cal.calibrate(0.37) == pytest.approx(0.37)
    assert cal.calibrate(1.5) == pytest.approx(1.0) and cal.calibrate(-1) == 0.0


def test_calibrator_converges_to_the_observed_rate() -> None:
    cal = Calibrator(num_bins=10)
    rng = random.Random(2)
    for _ in range(3000):  # raw 0.9 at every position, truly accepted half the time
        accepted = 0
        while accepted < 4 and rng.random() < 0.5:
            accepted += 1
        cal.observe([0.9] * 4, 4, accepted)
    # within the noise of the bin's ~200 outcomes and of the level's (it follows each outcome)
    assert cal.calibrate(0.9) == pytest.approx(0.5, abs=0.05)
    assert cal.calibrate(0.3) == pytest.approx(0.3, abs=0.05)  # a bin with no data: about raw
    (row,) = [b for b in cal.table() if b.trials]
    assert row.expected == pytest.approx(0.9) and row.observed == pytest.approx(0.5, abs=0.03)
    # what the policy expected as it went: raw at first, the observed rate once learned
    assert 0.5 < row.calibrated < 0.55
    assert row.lo == pytest.approx(0.9) and row.hi == pytest.approx(1.0)
    assert json.dumps([b.as_dict() for b in cal.table()])  # the benchmark report's form


def test_calibrator_follows_a_shift_in_traffic() -> None:
    # 20,000 positions at raw 0.97 accepted 97 % of the time (editing), then chat's at the same
    # raw confidence accepted 80 %: a few hundred of chat's must move the estimate there
    cal = Calibrator()
    rng = random.Random(4)
    for rate, n in ((0.97, 20000), (0.80, 600)):
        for _ in range(n):
            cal.observe([0.97], 1, int(rng.random() < rate))
    assert cal.calibrate(0.97) == pytest.approx(0.80, abs=0.05)
    (row,) = [b for b in cal.table() if b.trials]
    assert row.trials == 20600  # the report keeps every outcome
    forever = Calibrator(memory=1.0, level_rate=0.0)
    for rate, n in ((0.97, 20000), (0.80, 600)):
        for _ in range(n):
            forever.observe([0.97], 1, int(rng.random() < rate))
    assert forever.calibrate(0.97) > 0.95  # without forgetting, the old traffic decides
    with pytest.raises(ValueError, match="memory"):
        Calibrator(memory=0.0)


def test_a_shift_in_traffic_moves_every_bin_at_once() -> None:
    """Edits' drafts (accepted 5 points above their raw confidence), then chat's (15 below):
    500 of chat's outcomes over five bins, 100 each, while each bin remembers ~200. The level
    they share brings every bin near chat's rate, where the bins alone still expect more."""
    raws = [0.55, 0.65, 0.75, 0.85, 0.9]
    rng = random.Random(7)
    cals = {rate: Calibrator(level_rate=rate) for rate in (0.0, 0.02)}
    for shift, n in ((0.05, 4000), (-0.15, 100)):
        for _ in range(n):
            for c in raws:
                outcome = int(rng.random() < c + shift)
                for cal in cals.values():
                    cal.observe([c], 1, outcome)
    for c in raws:
        assert cals[0.02].calibrate(c) == pytest.approx(c - 0.15, abs=0.05)
        assert cals[0.0].calibrate(c) > c - 0.15 + 0.08  # the bins alone lag
    with pytest.raises(ValueError, match="level rate"):
        Calibrator(level_rate=1.0)


def test_calibrator_counts_only_tested_positions() -> None:
    cal = Calibrator(num_bins=4)
    cal.observe([0.1, 0.3, 0.6, 0.9], 4, 1)  # 0.1 accepted, 0.3 rejected, the rest untested
    cal.observe([0.6, 0.9], 1, 1)  # 0.6 accepted; 0.9 not verified
    cal.observe([0.9, 0.9], 0, 0)  # nothing verified
    assert [(b.trials, b.accepted) for b in cal.table()] == [(1, 1), (1, 0), (1, 1), (0, 0)]


# ---- cost table ---------------------------------------------------------------------------


def table() -> CostTable:
    return CostTable(
        [
            CostRow(1, [1, 3, 9], [1.0, 2.0, 5.0]),
            CostRow(4, [4, 12], [2.0, 6.0]),
        ],
        rollback_seconds=0.5,
        device="cpu",
    )


def test_cost_table_interpolates_in_tokens_and_seqs() -> None:
    t = table()
    assert t.seconds(1, 1) == 1.0 and t.seconds(9, 1) == 5.0
    assert t.seconds(2, 1) == pytest.approx(1.5)
    assert t.seconds(6, 1) == pytest.approx(3.5)
    assert t.seconds(8, 4) == pytest.approx(4.0)
    # between rows: each row at 8 tokens (1 seq: 4.5, 4 seqs: 4.0), then linear in seqs
    assert t.seconds(8, 2) == pytest.approx(4.5 - 0.5 / 3)


def test_cost_table_extrapolates_linearly() -> None:
    t = table()
    assert t.seconds(13, 1) == pytest.approx(7.0)  # the last segment's slope, 0.5 per token
    assert t.seconds(20, 4) == pytest.approx(10.0)
    assert t.seconds(12, 7) == pytest.approx(6.0 + (6.0 - 6.5))  # past the last row
    assert t.seconds(0, 1) == 1.0  # never below the cheapest measured step


def test_cost_table_prices_a_rows_context() -> None:
    """Every decode and draft row costs `context_seconds` a position beyond the grid's
    context (less short of it, never below the cheapest step); None leaves the grid's."""
    t = CostTable(table().rows, 0.5, "cpu", context=128, context_seconds=1e-3)
    assert t.seconds(12, 4, 2) == 6.0 and t.seconds(12, 4, 2, None) == 6.0
    assert t.seconds(12, 4, 2, 228) == pytest.approx(6.0 + 6 * 100 * 1e-3)
    assert t.seconds(12, 4, 0, 28) == pytest.approx(6.0 - 4 * 100 * 1e-3)
    steep = CostTable(table().rows, context=128, context_seconds=1e-2)
    assert steep.seconds(4, 4, 0, 0) == 1.0  # the cheapest measured step
    back = CostTable.from_json(t.to_json())
    assert back == t and back.context == 128 and back.context_seconds == 1e-3
    assert back.draft_context_seconds is None  # draft rows as decode rows
    with pytest.raises(ValueError, match="context"):
        CostTable(table().rows, context_seconds=-1.0)
    with pytest.raises(ValueError, match="context"):
        CostTable(table().rows, draft_context_seconds=-1.0)


def test_cost_table_prices_a_draft_rows_context_apart() -> None:
    """Draft rows that read their request's context with its decode row cost less a position:
    `draft_context_seconds`, kept through JSON."""
    t = CostTable(table().rows, context=128, context_seconds=1e-3, draft_context_seconds=2e-4)
    assert t.seconds(12, 4, 2, 228) == pytest.approx(6.0 + 100 * (4 * 1e-3 + 2 * 2e-4))
    back = CostTable.from_json(t.to_json())
    assert back == t and back.draft_context_seconds == 2e-4


def test_adaptive_prices_drafts_at_the_steps_context() -> None:
    """Drafts that pay at the grid's context do not at a long one, where each row (the
    decodes' too) reads 200 more positions: 4 decodes 0.04 s and 4 drafts at 0.5 survival
    0.01 s more at 128 positions; at 328, 0.12 s and 0.09 s more."""
    t = CostTable([CostRow(4, [4, 8], [0.04, 0.05])], context=128, context_seconds=1e-4)
    candidates = [Candidate(f"r{i}", [0.5], 1) for i in range(4)]
    policy = AdaptivePolicy(1, t)
    assert policy.choose(candidates, 4, 4) == [1] * 4
    assert policy.choose(candidates, 4, 4, 128) == [1] * 4
    assert policy.choose(candidates, 4, 4, 328) == [0] * 4


def test_cost_table_json_round_trip() -> None:
    t = table()
    back = CostTable.from_json(t.to_json())
    assert back == t and back.rollback_seconds == 0.5 and back.device == "cpu"
    assert back.seconds(8, 2) == t.seconds(8, 2)
    data = json.loads(t.to_json())
    data["version"] = 99
    with pytest.raises(ValueError, match="version"):
        CostTable.from_json(json.dumps(data))


def test_cost_table_rejects_bad_rows() -> None:
    with pytest.raises(ValueError):
        CostRow(1, [4, 2], [1.0, 2.0])
    with pytest.raises(ValueError):
        CostRow(1, [1], [0.0])
    with pytest.raises(ValueError):
        CostTable([CostRow(4, [4], [1.0]), CostRow(2, [2], [1.0])])
    with pytest.raises(ValueError):
        CostTable([])


def test_calibrate_all_is_calibrate_of_each() -> None:
    cal = Calibrator(num_bins=5)
    cal.observe([0.1, 0.5, 0.95], 3, 2)
    values = [-0.5, 0.0, 0.1, 0.2, 0.5, 0.95, 1.0, 1.7]
    assert cal.calibrate_all(values) == [cal.calibrate(v) for v in values]
