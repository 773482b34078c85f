"""Verify-length policies: a fixed k, or DSpark's adaptive budget (the draft slots that maximise
expected tokens per second of the step, from calibrated survival and the step-cost table)."""

from __future__ import annotations

from daemon.loop.spec.base import Candidate, SpecPolicy, StepCost
from daemon.loop.spec.calibration import Calibrator
from daemon.loop.spec.cost import CostTable

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


class AdaptivePolicy:
    """DSpark / vLLM's adaptive verification. A draft slot (i, j) survives with s_ij = the
    product of candidate i's calibrated confidences up to j; slots ranked by survival, the
    budget is B* = argmax_B (num_seqs + top-B survivals) / step seconds with B more tokens
    (plus `rollback_seconds` for each sequence that verifies any), B = 0 included and preferred
    on ties. Survival falls along a draft, so each candidate's chosen slots are a prefix."""

    def __init__(
        self,
        k: int,
        cost: StepCost,
        calibrator: Calibrator | None = None,
        rollback_seconds: float = 0.0,
    ) -> None:
        if k < 0:
            raise ValueError("k must be >= 0")
        self.k = k
        self.cost = cost
        self.calibrator = calibrator or Calibrator()
        self.rollback_seconds = rollback_seconds
        self.last_budget = 0
        self.last_expected = 0.0  # expected accepted drafts of the last budget

    def choose(self, candidates: list[Candidate], num_seqs: int, num_tokens: int) -> list[int]:
        slots: list[tuple[float, int, int]] = []  # (-survival, candidate, position)
        for i, c in enumerate(candidates):
            survival = 1.0
            n = max(0, min(self.k, c.max_len))
            for j, p in enumerate(self.calibrator.calibrate_all(c.confidence[:n])):
                survival *= p
                if survival <= 0.0:
                    break
                slots.append((-survival, i, j))
        # ties by position: a candidate's slot j always comes after its slot j - 1
        slots.sort()
        best_b, best_gain = 0, float(num_seqs)
        best_rate = best_gain / self.cost.seconds(num_tokens, num_seqs)
        gain, verifying = float(num_seqs), 0
        for b, (neg_survival, _, j) in enumerate(slots, 1):
            gain -= neg_survival
            verifying += int(j == 0)
            seconds = self.cost.seconds(num_tokens + b, num_seqs)
            rate = gain / (seconds + self.rollback_seconds * verifying)
            if rate > best_rate:
                best_b, best_gain, best_rate = b, gain, rate
        lengths = [0] * len(candidates)
        for _, i, _ in slots[:best_b]:
            lengths[i] += 1
        self.last_budget = best_b
        self.last_expected = best_gain - num_seqs
        return lengths

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        self.calibrator.observe(confidence, verified, accepted)


def build_policy(name: str, k: int, cost: StepCost | None = None) -> SpecPolicy:
    """The policy `name` (one of POLICIES) verifying at most `k` drafts per candidate;
    "adaptive" weighs drafts against `cost` (a `CostTable` brings its rollback term)."""
    if name == "fixed":
        return FixedPolicy(k)
    if name == "adaptive":
        if cost is None:
            raise ValueError("the adaptive spec policy needs a step-cost table")
        rollback = cost.rollback_seconds if isinstance(cost, CostTable) else 0.0
        return AdaptivePolicy(k, cost, rollback_seconds=rollback)
    raise ValueError(f"unknown spec policy {name!r}: choose one of {', '.join(POLICIES)}")
