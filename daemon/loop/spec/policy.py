"""Verify-length policies: a fixed k, or DSpark's adaptive budget (the draft slots that maximise
expected tokens per second of the step, from calibrated survival and the step-cost table)."""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.loop.spec.base import Candidate, SpecPolicy, StepCost
from daemon.loop.spec.calibration import Calibrator
from daemon.loop.spec.cost import CostTable
from daemon.loop.spec.online_cost import MeasuredCost

POLICIES = ("fixed", "adaptive")


class FixedPolicy:
    """Every candidate verifies min(k, max_len) drafts. Outcomes still feed a calibrator, for
    the report of expected vs observed acceptance."""

    def __init__(self, k: int, calibrator: Calibrator | None = None) -> None:
        if k < 0:
            raise ValueError("k must be >= 0")
        self.k = k
        self.calibrator = calibrator or Calibrator()
        self.last_budget = 0  # drafts verified in the last step chosen

    def choose(self, candidates: list[Candidate], num_seqs: int, num_tokens: int) -> list[int]:
        lengths = [max(0, min(self.k, c.max_len)) for c in candidates]
        self.last_budget = sum(lengths)
        return lengths

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        self.calibrator.observe(confidence, verified, accepted)

    def observe_step(self, num_tokens: int, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """Step times do not change a fixed length."""

    def calibration(self) -> list[dict[str, float | int | None]]:
        return [b.as_dict() for b in self.calibrator.table()]


class AdaptivePolicy:
    """DSpark / vLLM's adaptive verification. A draft slot (i, j) survives with s_ij = the
    product of candidate i's calibrated confidences up to j; slots ranked by survival, the
    budget is B* = argmax_B (num_seqs + top-B survivals - skipped) / step seconds with B more
    tokens (plus `rollback_seconds` for each sequence that verifies any), B = 0 included and
    preferred on ties. Survival falls along a draft, so each candidate's chosen slots are a
    prefix. `skip_tokens`: what a verifying sequence forgoes besides: under the overlap loop it
    sits out the next step (its length is known only once its verify is processed) while the
    others decode, so it pays 1 token, unless every sequence of the step verifies (then no next
    step runs without it)."""

    def __init__(
        self,
        k: int,
        cost: StepCost,
        calibrator: Calibrator | None = None,
        rollback_seconds: float = 0.0,
        skip_tokens: float = 0.0,
    ) -> None:
        if k < 0:
            raise ValueError("k must be >= 0")
        self.k = k
        self.cost = cost
        self.calibrator = calibrator or Calibrator()
        if skip_tokens < 0:
            raise ValueError("skip_tokens must be >= 0")
        self.rollback_seconds = rollback_seconds
        self.skip_tokens = skip_tokens
        self.last_budget = 0
        self.last_expected = 0.0  # expected accepted drafts of the last budget

    def choose(self, candidates: list[Candidate], num_seqs: int, num_tokens: int) -> list[int]:
        survivals = [self._survivals(c) for c in candidates]
        best = _Plan(float(num_seqs) / self.cost.seconds(num_tokens, num_seqs), float(num_seqs))
        # with a skipped step to pay, a candidate's first slots go as one item (the prefix
        # worth most per slot after it); ranked by survival alone too, for the steps where
        # every sequence verifies and no one skips
        penalties = (0.0, self.skip_tokens) if self.skip_tokens else (0.0,)
        for penalty in penalties:
            plan = self._scan(_items(survivals, penalty), len(candidates), num_seqs, num_tokens)
            if plan.rate > best.rate:
                best = plan
        self.last_budget = sum(best.lengths)
        self.last_expected = best.gain - num_seqs
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

    def _scan(
        self, items: list[_Item], num_candidates: int, num_seqs: int, num_tokens: int
    ) -> _Plan:
        """The best prefix of `items` (in their order) by expected tokens per second."""
        seconds_of, skip, rollback = self.cost.seconds, self.skip_tokens, self.rollback_seconds
        best_rate, best_gain, best_items = 0.0, float(num_seqs), 0
        gain, tokens, verifying = float(num_seqs), 0, 0
        for b, (_, _, _, count, item_gain, first) in enumerate(items, 1):
            gain += item_gain
            tokens += count
            verifying += first
            skipped = skip * verifying if verifying < num_seqs else 0.0
            seconds = seconds_of(num_tokens + tokens, num_seqs, tokens)
            rate = (gain - skipped) / (seconds + rollback * verifying)
            if rate > best_rate:
                best_rate, best_gain, best_items = rate, gain, b
        lengths = [0] * num_candidates
        for item in items[:best_items]:
            lengths[item[1]] += item[3]
        return _Plan(best_rate, best_gain, best_items, lengths)

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        self.calibrator.observe(confidence, verified, accepted)

    def observe_step(self, num_tokens: int, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """A step's measured time, to a cost that learns from it."""
        if isinstance(self.cost, MeasuredCost):
            self.cost.observe(num_tokens, num_seqs, num_drafts, seconds)

    def calibration(self) -> list[dict[str, float | int | None]]:
        return [b.as_dict() for b in self.calibrator.table()]


# slots verified together, ranked as tuples: (minus the value per slot, candidate, position of
# its first slot (a candidate's items in draft order on ties), count, their survivals summed,
# 1 if from the candidate's first slot else 0)
_Item = tuple[float, int, int, int, float, int]


@dataclass
class _Plan:
    rate: float  # expected tokens per second
    gain: float  # expected tokens (num_seqs and the accepted drafts)
    items: int = 0  # of the ranked items taken
    lengths: list[int] = field(default_factory=list)


def _items(survivals: list[list[float]], penalty: float) -> list[_Item]:
    """Every candidate's slots ranked for the budget scan. A candidate's first L slots form
    one item worth (S(L) - penalty) / L per slot, for the L that maximises it (L = 1 where
    there is no penalty, survival falling along a draft), its later slots one each: none of
    them is worth more per slot than that prefix, so items keep each candidate's draft order.
    A candidate whose best prefix does not pay `penalty` has no items."""
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
    name: str, k: int, cost: StepCost | None = None, overlap: bool = False
) -> SpecPolicy:
    """The policy `name` (one of POLICIES) verifying at most `k` drafts per candidate;
    "adaptive" weighs drafts against `cost` (a `CostTable` brings its rollback term, and is
    corrected online by the steps the engine measures: `MeasuredCost`) and, under the overlap
    loop (`overlap`), the step a verifying sequence sits out."""
    if name == "fixed":
        return FixedPolicy(k)
    if name == "adaptive":
        if cost is None:
            raise ValueError("the adaptive spec policy needs a step-cost table")
        rollback = 0.0
        if isinstance(cost, CostTable):
            rollback, cost = cost.rollback_seconds, MeasuredCost(cost)
        return AdaptivePolicy(k, cost, rollback_seconds=rollback, skip_tokens=float(overlap))
    raise ValueError(f"unknown spec policy {name!r}: choose one of {', '.join(POLICIES)}")
