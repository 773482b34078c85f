"""Online calibration of a drafter's raw confidence against observed acceptance: binned by
confidence, each bin's rate pulled toward the raw value until it has seen enough outcomes, and
a level shared by the bins that follows every outcome."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class CalibrationBin:
    """One confidence bin: what the drafter promised there and what verification found."""

    lo: float
    hi: float
    trials: int = 0  # draft positions tested (accepted or rejected)
    accepted: int = 0
    confidence_sum: float = 0.0  # of the raw confidences tested
    # of the calibrated acceptance each tested position had when it was observed (what the
    # policy expected of it)
    calibrated_sum: float = 0.0

    @property
    def expected(self) -> float | None:
        """The mean raw confidence of the positions tested (None: none yet)."""
        return self.confidence_sum / self.trials if self.trials else None

    @property
    def calibrated(self) -> float | None:
        """The mean calibrated acceptance of the positions tested (None: none yet)."""
        return self.calibrated_sum / self.trials if self.trials else None

    @property
    def observed(self) -> float | None:
        return self.accepted / self.trials if self.trials else None

    def as_dict(self) -> dict:
        return asdict(self) | {
            "expected": self.expected,
            "calibrated": self.calibrated,
            "observed": self.observed,
        }


class Calibrator:
    """Maps a raw confidence c to an acceptance probability: in c's bin, (accepted + prior * c)
    / (trials + prior) over counts that decay by `memory` per outcome in the bin, so it starts
    at the raw value, converges to the observed rate and follows it when traffic shifts (a bin
    weighs about its last 1 / (1 - memory) outcomes: one kind of request must not set what
    another is expected to accept). The table reports lifetime counts.

    A bin follows a shift only as fast as outcomes reach it, and a shift moves every bin: after
    edits (raw 0.80-0.85 accepted 84 %), chat's 0.80-0.85 were accepted 68 % while the bins
    still said 81 %, and the policy verified drafts that did not pay. So a level, shared by the
    bins, follows every outcome: the bin's odds times exp(`level`), `level` fitted online as a
    logistic intercept (a step of `level_rate` times each outcome's surprise). Once the bins
    have learned the new traffic the surprises average 0 and the level returns to 0."""

    def __init__(
        self,
        num_bins: int = 20,
        prior: float = 16.0,
        memory: float = 0.995,
        level_rate: float = 0.02,
    ) -> None:
        if num_bins < 1:
            raise ValueError("a calibrator needs at least one bin")
        if prior <= 0:
            raise ValueError("the calibration prior must be > 0")
        if not 0.0 < memory <= 1.0:
            raise ValueError("the calibration memory must be in (0, 1]")
        if not 0.0 <= level_rate < 1.0:
            raise ValueError("the calibration level rate must be in [0, 1)")
        self.num_bins = num_bins
        self.prior = prior
        self.memory = memory
        self.level_rate = level_rate
        self.level = 0.0  # log odds added to every bin's
        self._odds = 1.0  # exp(level)
        self.recent_trials = [0.0] * num_bins  # decayed counts: what calibrate uses
        self.recent_accepted = [0.0] * num_bins
        self.trials = [0] * num_bins
        self.accepted = [0] * num_bins
        self.confidence_sum = [0.0] * num_bins
        self.calibrated_sum = [0.0] * num_bins

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.num_bins), self.num_bins - 1)

    def calibrate(self, confidence: float) -> float:
        return _shifted(self._binned(confidence), self._odds)

    def _binned(self, confidence: float) -> float:
        """c's bin's estimate, without the level."""
        c = min(max(confidence, 0.0), 1.0)
        b = self._bin(c)
        return (self.recent_accepted[b] + self.prior * c) / (self.recent_trials[b] + self.prior)

    def calibrate_all(self, confidence: list[float]) -> list[float]:
        """`calibrate` of each (the policy's per-step call, so with its lookups hoisted)."""
        n, prior, k = self.num_bins, self.prior, self._odds
        trials, accepted = self.recent_trials, self.recent_accepted
        out = []
        for c in confidence:
            c = 0.0 if c < 0.0 else 1.0 if c > 1.0 else c
            b = min(int(c * n), n - 1)
            out.append(_shifted((accepted[b] + prior * c) / (trials[b] + prior), k))
        return out

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        """A draft verified at its first `verified` positions, of which the first `accepted`
        were accepted: those are successes, the one after them (if verified) a failure; later
        positions were never tested."""
        tested = min(accepted + 1, verified, len(confidence))
        for j in range(tested):
            c = min(max(confidence[j], 0.0), 1.0)
            b = self._bin(c)
            expected = self.calibrate(c)
            self.calibrated_sum[b] += expected
            if self.level_rate:  # the log likelihood's gradient in the level: the surprise
                self.level += self.level_rate * (float(j < accepted) - expected)
                self._odds = math.exp(self.level)
            m = self.memory
            self.recent_trials[b] = self.recent_trials[b] * m + 1.0
            self.recent_accepted[b] = self.recent_accepted[b] * m + float(j < accepted)
            self.trials[b] += 1
            self.accepted[b] += int(j < accepted)
            self.confidence_sum[b] += c

    def table(self) -> list[CalibrationBin]:
        """Every bin, expected (raw) vs observed acceptance: for the benchmark's report."""
        n = self.num_bins
        return [
            CalibrationBin(
                b / n, (b + 1) / n, self.trials[b], self.accepted[b], s, self.calibrated_sum[b]
            )
            for b, s in enumerate(self.confidence_sum)
        ]


def _shifted(p: float, odds: float) -> float:
    """`p` with its odds multiplied by `odds` (0 and 1 stay)."""
    if odds == 1.0:
        return p
    return p * odds / (1.0 - p + p * odds)
