"""The step-cost table corrected online by the steps the engine runs: at batch sizes anchored at
the powers of two (a step between two anchors teaches both, and is priced from both, each by its
nearness, so the correction has no step where a bucket would end), and apart for steps with and
without prefill chunks, a decaying ridge fit of (measured - table) seconds against the step's
draft tokens, its chunk tokens and whether it verifies at all (centred: a level error stays in
the intercept), so a table profiled on a busy machine, or one whose slope misses, stops
misleading the policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from daemon.loop.spec.cost import CostTable

MEMORY = 0.98  # weight an observation keeps per later one in its fit: about the last 50
# the fit's prior, in observations' worth: an intercept of 0 (as good as 2 steps), a draft slope
# of 0 as good as 2 steps 8 drafts from the fit's mean, a chunk slope of 0 as good as 2 steps 64
# chunk tokens from its mean, a verify cost of 0 as good as half a step; so decode-only steps move
# the intercept alone and the table's slopes stand until steps that differ measure their own
RIDGE = (2.0, 2.0 * 8.0**2, 2.0 * 64.0**2, 0.5)
FEATURES = len(RIDGE)  # (1, draft tokens, chunk tokens, 1 if the step verifies any draft)
FLOOR = 0.25  # a corrected cost never falls below this share of the table's
# a step's time is taken within this share of its current price: a step slowed by other work
# on the machine (the store's writers after a wave of prefills, a burst of HTTP) moves the fit
# as one this far off would. One step twice its price at 32 sequences (163 ms, its 111 drafts
# priced 82) made every later draft there look dearer than a decode row, and a policy that
# declines them measures no more; a price that is truly off is reached over a few steps.
CLIP = 0.25


@dataclass
class _Fit:
    """Weighted sums of one fit's residuals y against the features (1, drafts, chunk tokens,
    verifies), decayed per observation."""

    xx: list[list[float]] = field(
        default_factory=lambda: [[0.0] * FEATURES for _ in range(FEATURES)]
    )
    xy: list[float] = field(default_factory=lambda: [0.0] * FEATURES)
    _coef: tuple[float, ...] | None = None

    @property
    def weight(self) -> float:
        return self.xx[0][0]

    def add(self, drafts: float, chunk: float, y: float, memory: float, weight: float) -> None:
        """An observation of `weight` (a share of a step): it ages the older ones by
        memory**weight, so a fit taught by parts of steps forgets as fast per step."""
        x = (1.0, drafts, chunk, _verifies(drafts, chunk))
        decay = memory**weight
        for i in range(FEATURES):
            self.xy[i] = self.xy[i] * decay + weight * x[i] * y
            row = self.xx[i]
            for j in range(FEATURES):
                row[j] = row[j] * decay + weight * x[i] * x[j]
        self._coef = None

    def coef(self) -> tuple[float, ...]:
        """(intercept, draft slope, chunk slope, verify cost): the last three by ridge
        regression on the features centred at their weighted means, then the intercept from
        the mean residual (shrunk by its own ridge term). Centred, they learn only from how
        the residual moves with the drafts, the chunk and whether a step verifies: a level
        error of the table (a busier machine, a context its context term misses) goes to the
        intercept, not to the drafts when a budget seldom strays far from its mean."""
        if self._coef is None:
            w, mx, y = self.xx[0][0], self.xx[0][1:], self.xy[0]
            rest = range(1, FEATURES)
            a = [
                [
                    self.xx[i][j] - mx[i - 1] * mx[j - 1] / w + (RIDGE[i] if i == j else 0.0)
                    for j in rest
                ]
                for i in rest
            ]
            b = [self.xy[i] - mx[i - 1] * y / w for i in rest]
            slopes = _solve(a, b)
            intercept = (y - sum(m * s for m, s in zip(mx, slopes))) / (w + RIDGE[0])
            self._coef = (intercept, *slopes)
        return self._coef


@dataclass
class MeasuredCost:
    """A `StepCost`: `table`'s seconds plus the fitted correction at the step's batch size,
    for steps with prefill chunks or without.

    The fits sit at anchors, batch sizes 1, 2, 4, ...: a step of s sequences between anchors
    a and 2a teaches the fit at a with weight (2a - s) / a and the one at 2a with the rest, and
    is priced by the same blend of the two (an anchor not yet taught blends as no correction).
    Under overlap a verifying sequence sits out the next step, and the policy prices that by
    the step without it: fits that ended where a power of two does would put the gap between
    two intercepts into the price of sitting out, at the batch sizes most runs have.

    Steps with chunks are fitted apart from those without: they run another way (eagerly, where
    chunk-free decodes may replay a captured graph) and their residual carries the table's error
    on the chunk, so a draft row costs them another amount. The chunk's tokens are a known
    covariate of that fit, not left to its intercept: drafts take the token budget the chunks
    leave, so a step with more drafts has smaller chunks, and a fit on the drafts alone would
    charge them the table's error on the chunk tokens they displaced.

    A chunk-free step that verifies any draft has a cost of its own, fitted apart from the
    per-draft slope: a step's cost is not linear in its rows (SmolLM2 on 2 Xeon cores with
    AMX: 32 decodes 59.4 ms, 33 64.4 ms, then ~0.7 ms a row to 48), and verifying selects the
    sampled rows and runs the verify. The table's rows at 16 and 64 sequences interpolate over
    such a jump, and a slope fitted to 1 to 10 drafts a step spreads it thin: a first draft at
    32 sequences was priced ~1.3 ms where it costs 6.6 (bench.spec_cost --verify 1x1)."""

    table: CostTable
    memory: float = MEMORY
    _fits: dict[tuple[int, bool], _Fit] = field(default_factory=dict)

    @property
    def rollback_seconds(self) -> float:
        return self.table.rollback_seconds

    def seconds(
        self, num_tokens: int, num_seqs: int, num_drafts: int = 0, context: float | None = None
    ) -> float:
        base = self.table.seconds(num_tokens, num_seqs, num_drafts, context)
        return self._corrected(base, num_seqs, num_drafts, num_tokens - num_seqs - num_drafts)

    def _corrected(self, base: float, num_seqs: int, num_drafts: int, chunk: int) -> float:
        """The table's `base` seconds of a step plus the fits' correction at its batch size."""
        correction = 0.0
        for anchor, share in _anchors(num_seqs):
            fit = self._fits.get((anchor, chunk > 0))
            if fit is not None:
                a, b, c, v = fit.coef()
                verifies = _verifies(num_drafts, chunk)
                correction += share * (a + b * num_drafts + c * chunk + v * verifies)
        return max(base + correction, FLOOR * base)

    def observe(
        self,
        num_tokens: int,
        num_seqs: int,
        num_drafts: int,
        seconds: float,
        context: float | None = None,
    ) -> None:
        """A step of `num_tokens` rows over `num_seqs` sequences, `num_drafts` of them draft
        (verify) rows, the rest beyond one per sequence prefill chunks' tokens, took `seconds`
        (host preparation and the device's step, as the table measured); its decode and draft
        rows attended `context` positions on average (None: as the table's). Taken within
        CLIP of the step's current price."""
        chunk = num_tokens - num_seqs - num_drafts
        if num_seqs < 1 or num_drafts < 0 or chunk < 0 or not seconds > 0:
            return
        base = self.table.seconds(num_tokens, num_seqs, num_drafts, context)
        price = self._corrected(base, num_seqs, num_drafts, chunk)
        residual = min(max(seconds, price * (1.0 - CLIP)), price * (1.0 + CLIP)) - base
        for anchor, share in _anchors(num_seqs):
            fit = self._fits.setdefault((anchor, chunk > 0), _Fit())
            fit.add(float(num_drafts), float(chunk), residual, self.memory, share)

    def corrections(self) -> list[dict[str, float | bool]]:
        """Each fit: its anchor's batch size, whether of steps with chunks, its weight, the
        intercept (s), slopes (s per draft token, s per chunk token) and the verify cost (s a
        step that verifies any draft)."""
        out: list[dict[str, float | bool]] = []
        for (anchor, chunks), fit in sorted(self._fits.items()):
            a, b, c, v = fit.coef()
            out.append(
                {
                    "seqs": anchor,
                    "chunks": chunks,
                    "weight": round(fit.weight, 2),
                    "intercept_s": round(a, 6),
                    "slope_s_per_token": round(b, 7),
                    "chunk_slope_s_per_token": round(c, 7),
                    "verify_s": round(v, 6),
                }
            )
        return out


def _verifies(drafts: float, chunk: float) -> float:
    """The verify feature: 1 for a chunk-free step with drafts. Beside a chunk the rows are
    many anyway, and a step without drafts has chunks where a step with them has few (drafts
    take the budget a prompt's last chunk leaves): there it would take the chunk's slope."""
    return 1.0 if drafts > 0 and chunk == 0 else 0.0


@lru_cache(maxsize=1024)  # the policy prices the same batch size many times a step
def _anchors(num_seqs: int) -> tuple[tuple[int, float], ...]:
    """The anchors (powers of two) a step of `num_seqs` sequences is fitted at, with shares
    summing to 1: itself where it is one, else the two around it by nearness (none for no
    sequence)."""
    if num_seqs < 1:
        return ()
    low = 1 << (num_seqs.bit_length() - 1)
    if low == num_seqs:
        return ((low, 1.0),)
    high_share = (num_seqs - low) / low
    return ((low, 1.0 - high_share), (2 * low, high_share))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b, `a` symmetric positive definite (the ridge makes it so): Gaussian
    elimination, in place."""
    n = len(b)
    for k in range(n):
        for i in range(k + 1, n):
            f = a[i][k] / a[k][k]
            for j in range(k, n):
                a[i][j] -= f * a[k][j]
            b[i] -= f * b[k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x
