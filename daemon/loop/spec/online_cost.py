"""The step-cost table corrected online by the steps the engine runs: per batch-size bucket, a
decaying ridge fit of (measured - table) seconds against the step's tokens beyond one per
sequence, so a table profiled on a busy machine, or one whose slope misses, stops misleading
the policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.loop.spec.cost import CostTable

MEMORY = 0.98  # weight an observation keeps per later one in its bucket: about the last 50
# the fit's prior, in observations' worth: an intercept of 0 (as good as 2 steps), a slope of 0
# as good as 2 steps with 8 drafts each; so decode-only steps move the intercept alone and the
# table's slope stands until verify steps measure their own
RIDGE_INTERCEPT = 2.0
RIDGE_SLOPE = 2.0 * 8.0**2
FLOOR = 0.25  # a corrected cost never falls below this share of the table's


@dataclass
class _Fit:
    """Weighted sums of one bucket's residuals y against x, decayed per observation."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    _coef: tuple[float, float] | None = None

    def add(self, x: float, y: float, memory: float) -> None:
        self.w = self.w * memory + 1.0
        self.x = self.x * memory + x
        self.y = self.y * memory + y
        self.xx = self.xx * memory + x * x
        self.xy = self.xy * memory + x * y
        self._coef = None

    def coef(self) -> tuple[float, float]:
        """(intercept, slope) minimising the weighted squares plus the ridge terms."""
        if self._coef is None:
            a11, a12, a22 = self.w + RIDGE_INTERCEPT, self.x, self.xx + RIDGE_SLOPE
            det = a11 * a22 - a12 * a12
            self._coef = (
                (self.y * a22 - a12 * self.xy) / det,
                (a11 * self.xy - a12 * self.y) / det,
            )
        return self._coef


@dataclass
class MeasuredCost:
    """A `StepCost`: `table`'s seconds plus the fitted correction of the step's bucket
    (sequences by powers of two). Only steps without prefill chunks are observed: the policy's
    choices move drafts, which those steps carry; a chunk's cost stays the table's."""

    table: CostTable
    memory: float = MEMORY
    _fits: dict[int, _Fit] = field(default_factory=dict)

    @property
    def rollback_seconds(self) -> float:
        return self.table.rollback_seconds

    def seconds(self, num_tokens: int, num_seqs: int) -> float:
        base = self.table.seconds(num_tokens, num_seqs)
        fit = self._fits.get(num_seqs.bit_length())
        if fit is None:
            return base
        a, b = fit.coef()
        return max(base + a + b * (num_tokens - num_seqs), FLOOR * base)

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """A chunk-free step of `num_tokens` rows over `num_seqs` sequences took `seconds`
        (host preparation and the device's step, as the table measured)."""
        if num_seqs < 1 or num_tokens < num_seqs or not seconds > 0:
            return
        residual = seconds - self.table.seconds(num_tokens, num_seqs)
        fit = self._fits.setdefault(num_seqs.bit_length(), _Fit())
        fit.add(float(num_tokens - num_seqs), residual, self.memory)

    def corrections(self) -> list[dict[str, float]]:
        """Each bucket's fit: its sequences' range, the intercept (s) and slope (s per token)."""
        out = []
        for bucket, fit in sorted(self._fits.items()):
            a, b = fit.coef()
            out.append(
                {
                    "min_seqs": 1 << (bucket - 1),
                    "max_seqs": (1 << bucket) - 1,
                    "weight": round(fit.w, 2),
                    "intercept_s": round(a, 6),
                    "slope_s_per_token": round(b, 7),
                }
            )
        return out
