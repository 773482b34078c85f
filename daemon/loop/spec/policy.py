"""Verify-length policies: a fixed k, or DSpark's adaptive budget (the draft slots that maximise
expected tokens per second of the step, from calibrated survival and the step-cost table)."""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.loop.spec.base import OVERLAP_MIN_SHARE, Candidate, SpecPolicy, StepCost
from daemon.loop.spec.calibration import Calibrator
from daemon.loop.spec.cost import CostTable
from daemon.loop.spec.online_cost import MeasuredCost

POLICIES = ("fixed", "adaptive")
# adaptive: drafts verify only where the model expects them to beat verifying none by this share
MIN_GAIN = 0.1


class FixedPolicy:
    """Every candidate verifies min(k, max_len) drafts. Outcomes still feed a calibrator, for
    the report of expected vs observed acceptance."""

    def __init__(self, k: int, calibrator: Calibrator | None = None) -> None:
        if k < 0:
            raise ValueError("k must be >= 0")
        self.k = k
        self.calibrator = calibrator or Calibrator()
        self.last_budget = 0  # drafts verified in the last step chosen

    def choose(
        self,
        candidates: list[Candidate],
        num_seqs: int,
        num_tokens: int,
        context: float | None = None,
    ) -> list[int]:
        lengths = [max(0, min(self.k, c.max_len)) for c in candidates]
        self.last_budget = sum(lengths)
        return lengths

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        self.calibrator.observe(confidence, verified, accepted)

    def observe_step(
        self,
        num_tokens: int,
        num_seqs: int,
        num_drafts: int,
        seconds: float,
        context: float | None = None,
    ) -> None:
        """Step times do not change a fixed length."""

    def calibration(self) -> list[dict[str, float | int | None]]:
        return [b.as_dict() for b in self.calibrator.table()]


class AdaptivePolicy:
    """DSpark / vLLM's adaptive verification. A draft slot (i, j) survives with s_ij = the
    product of candidate i's calibrated confidences up to j; slots ranked by survival, the
    budget is B* = argmax_B (num_seqs + top-B survivals) / seconds, B = 0 included and
    preferred on ties. Survival falls along a draft, so each candidate's chosen slots are a
    prefix.

    The seconds are the step's decode time, not its prefill chunk's: a decode step of the same
    sequences plus what the B draft rows add to the step (never less than nothing), plus
    `rollback_seconds` for each sequence that verifies any. A chunk's seconds are spent
    whatever is drafted, and the time drafts take would otherwise go to decoding at the decode
    step's rate; counted in, a chunk made drafts beside it look nearly free.

    `hold` (the overlap loop): a verifying sequence sits out the next step (its length is known
    only once its verify is processed) while the others run it as decodes, so a plan is priced
    over both steps: its tokens plus the others' next ones, over its seconds plus a decode step
    of the others. Where fewer than OVERLAP_MIN_SHARE of the sequences would be left to run
    it (every sequence verifying, say), no next step runs without them (the loop's work, then
    not hidden behind a step, is not priced).

    `min_gain`: a plan with drafts is taken only where its expected rate beats verifying
    none by that share. The expectation is a model (a table, an online fit, calibrated
    confidences) whose error is some percent, and where the batch already fills the device a
    draft row costs nearly what the token it may save is worth (SmolLM2 on 2 Zen 5 cores, 32
    sequences at ~300 positions: a decode row 1.1 ms, a draft row 0.9): there the best plan
    is a few percent above none by the model, and as likely below it in fact."""

    def __init__(
        self,
        k: int,
        cost: StepCost,
        calibrator: Calibrator | None = None,
        rollback_seconds: float = 0.0,
        hold: bool = False,
        min_gain: float = 0.0,
    ) -> None:
        if k < 0:
            raise ValueError("k must be >= 0")
        if rollback_seconds < 0:
            raise ValueError("rollback_seconds must be >= 0")
        if min_gain < 0:
            raise ValueError("min_gain must be >= 0")
        self.k = k
        self.cost = cost
        self.calibrator = calibrator or Calibrator()
        self.rollback_seconds = rollback_seconds
        self.hold = hold
        self.min_gain = min_gain
        self.last_budget = 0
        self.last_expected = 0.0  # expected accepted drafts of the last budget

    def choose(
        self,
        candidates: list[Candidate],
        num_seqs: int,
        num_tokens: int,
        context: float | None = None,
    ) -> list[int]:
        survivals = [self._survivals(c) for c in candidates]
        step = _Step(self.cost, num_seqs, num_tokens, context)
        none = _Plan(num_seqs / step.decode, 0.0)
        best = none
        orders = [_items(survivals, 0.0)]  # ranked by survival
        if self.hold:
            # a candidate's first slots as one item (the prefix worth most per slot after the
            # token it forgoes in the step it sits out); and every candidate's first slot
            # ahead of the rest (where enough verify, none sits out: OVERLAP_MIN_SHARE)
            orders.append(_items(survivals, 1.0))
            orders.append(sorted(orders[0], key=lambda item: not item[5]))
        for items in orders:
            plan = self._scan(items, len(candidates), step)
            if plan.rate > best.rate:
                best = plan
        if best.rate < none.rate * (1.0 + self.min_gain):
            best = none
        self.last_budget = sum(best.lengths)
        self.last_expected = best.expected
        return best.lengths or [0] * len(candidates)

    def _survivals(self, c: Candidate) -> list[float]:
        """Candidate `c`'s calibrated survival at each draft position it may verify."""
        out, survival = [], 1.0
        for p in self.calibrator.calibrate_all(c.confidence[: max(0, min(self.k, c.max_len))]):
            survival *= p
            if survival <= 0.0:
                break
            out.append(survival)
        return out

    def _scan(self, items: list[_Item], num_candidates: int, step: _Step) -> _Plan:
        """The best prefix of `items` (in their order) by expected tokens per second."""
        best = _Plan(0.0, 0.0)
        expected, drafts, verifying = 0.0, 0, 0
        for b, (_, _, _, count, item_gain, first) in enumerate(items, 1):
            expected += item_gain
            drafts += count
            verifying += first
            rate = step.rate(expected, drafts, verifying, self.rollback_seconds, self.hold)
            if rate > best.rate:
                best = _Plan(rate, expected, b)
        best.lengths = [0] * num_candidates
        for item in items[: best.items]:
            best.lengths[item[1]] += item[3]
        return best

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        self.calibrator.observe(confidence, verified, accepted)

    def observe_step(
        self,
        num_tokens: int,
        num_seqs: int,
        num_drafts: int,
        seconds: float,
        context: float | None = None,
    ) -> None:
        """A step's measured time, to a cost that learns from it."""
        if isinstance(self.cost, MeasuredCost):
            self.cost.observe(num_tokens, num_seqs, num_drafts, seconds, context)

    def calibration(self) -> list[dict[str, float | int | None]]:
        return [b.as_dict() for b in self.calibrator.table()]


# slots verified together, ranked as tuples: (minus the value per slot, candidate, position of
# its first slot (a candidate's items in draft order on ties), count, their survivals summed,
# 1 if from the candidate's first slot else 0)
_Item = tuple[float, int, int, int, float, int]


@dataclass
class _Plan:
    rate: float  # expected tokens per second
    expected: float  # expected accepted drafts
    items: int = 0  # of the ranked items taken
    lengths: list[int] = field(default_factory=list)


class _Step:
    """The step being planned: `num_seqs` sequences, `num_tokens` tokens without drafts (the
    rest beyond one per sequence a chunk's), its decodes at `context` positions, and the costs
    a plan's rate is made of."""

    def __init__(
        self, cost: StepCost, num_seqs: int, num_tokens: int, context: float | None
    ) -> None:
        self.cost, self.num_seqs, self.num_tokens = cost, num_seqs, num_tokens
        self.context = context
        self.base = cost.seconds(num_tokens, num_seqs, 0, context)
        self.decode = (
            cost.seconds(num_seqs, num_seqs, 0, context) if num_tokens > num_seqs else self.base
        )

    def rate(
        self, expected: float, drafts: int, verifying: int, rollback: float, hold: bool
    ) -> float:
        """Expected tokens per second of the plan: `drafts` draft rows over `verifying`
        sequences, `expected` of them accepted; with `hold`, over this step and the next."""
        seqs = self.num_seqs
        added = self.cost.seconds(self.num_tokens + drafts, seqs, drafts, self.context) - self.base
        gain = seqs + expected
        seconds = self.decode + max(added, 0.0) + rollback * verifying
        if hold and 0 < verifying < seqs and seqs - verifying >= OVERLAP_MIN_SHARE * seqs:
            others = seqs - verifying
            gain += others
            seconds += self.cost.seconds(others, others, 0, self.context)
        return gain / seconds


def _items(survivals: list[list[float]], penalty: float) -> list[_Item]:
    """Every candidate's slots ranked for the budget scan. A candidate's first L slots form
    one item worth (S(L) - penalty) / L per slot, for the L that maximises it (L = 1 where
    there is no penalty, survival falling along a draft), its later slots one each: none of
    them is worth more per slot than that prefix, so items keep each candidate's draft order.
    A candidate whose best prefix does not pay `penalty` (the token a held sequence forgoes)
    has no items."""
    items: list[_Item] = []
    for i, s in enumerate(survivals):
        best_l, best_v, total = 0, 0.0, 0.0
        for n, v in enumerate(s, 1):
            total += v
            if (total - penalty) / n > best_v:
                best_l, best_v = n, (total - penalty) / n
        if best_l == 0:
            continue
        items.append((-best_v, i, 0, best_l, sum(s[:best_l]), 1))
        items.extend((-v, i, j, 1, v, 0) for j, v in enumerate(s[best_l:], best_l))
    items.sort()
    return items


def build_policy(
    name: str,
    k: int,
    cost: StepCost | None = None,
    overlap: bool = False,
    min_gain: float = 0.0,
) -> SpecPolicy:
    """The policy `name` (one of POLICIES) verifying at most `k` drafts per candidate;
    "adaptive" weighs drafts against `cost` (a `CostTable` brings its rollback term, and is
    corrected online by the steps the engine measures: `MeasuredCost`) and, under the overlap
    loop (`overlap`), the step a verifying sequence sits out, and verifies any only where
    the expected rate beats none's by `min_gain`."""
    if name == "fixed":
        return FixedPolicy(k)
    if name == "adaptive":
        if cost is None:
            raise ValueError("the adaptive spec policy needs a step-cost table")
        rollback = 0.0
        if isinstance(cost, CostTable):
            rollback, cost = cost.rollback_seconds, MeasuredCost(cost)
        return AdaptivePolicy(k, cost, rollback_seconds=rollback, hold=overlap, min_gain=min_gain)
    raise ValueError(f"unknown spec policy {name!r}: choose one of {', '.join(POLICIES)}")
