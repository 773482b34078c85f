"""Expert load statistics: per-layer token counts taken every `stats_interval` steps into a
moving window of the last `window` intervals, and a model of how expert popularity drifts
between them (used to hedge placements against drift until the next rebalance)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

# log load ratio of two experts adjacent in popularity order: bins of the swap statistics
GAP_EDGES = np.array([0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, np.inf])
# a pair counts when its gap exceeds _Z standard deviations of the count noise, and has
# swapped when the reversed gap afterwards exceeds _Z_FLIP of them (a noise reversal that far
# from _Z is rare, a real swap of a gap that large is rarely missed)
_Z, _Z_FLIP = 3.0, 1.0
_MAX_FLIP = 0.45
_SCALES = np.geomspace(0.002, 2.0, 31)
_FLIPS = np.geomspace(1e-5, 1.0, 601)  # `flip` grid (swap_rates caps flip * tail at _MAX_FLIP)
# a gap-dependent rate must beat the gap-independent one by this much log-likelihood: wrongly
# finding one drops the hedge for the hottest experts, so far beyond a 1% likelihood-ratio test
# (3.3); continuous drift gives hundreds
_SCALE_EVIDENCE = 10.0


@dataclass(frozen=True)
class SwapModel:
    """Drift as a random walk of the popularity order: two experts adjacent in the order
    (loads sorted) trade places, so the sorted load curve stays and the experts move along it.
    The probability that an adjacent pair with log load gap g has swapped (an odd number of
    times) after one stats interval is flip * 2 * Phi(-g / scale): scale = inf is a
    gap-independent swap rate (popularity ranks random-walk), a small scale means only
    near-equal experts trade places (loads moving continuously)."""

    flip: float = 0.0
    scale: float = math.inf

    def swap_rates(self, curve: np.ndarray) -> np.ndarray:
        """Swaps per stats interval of each adjacent position pair of a sorted load curve."""
        g = np.log(np.maximum(curve[:-1], 1e-300) / np.maximum(curve[1:], 1e-300))
        f = np.minimum(self.flip * _tail(g / self.scale), _MAX_FLIP)
        return -np.log1p(-2 * f) / 2  # P(odd count) = (1 - exp(-2 rate)) / 2

    @classmethod
    def fit(cls, trials: np.ndarray, flips: np.ndarray, gap_sum: np.ndarray) -> SwapModel:
        """Maximum likelihood over GAP_EDGES bins (from `swap_counts`): the gap-independent
        rate unless a finite scale (on a grid) is clearly more likely."""
        m = trials > 0
        if not m.any() or flips[m].sum() <= 0:
            return cls()
        n, k, g = trials[m], flips[m], gap_sum[m] / trials[m]

        def best(w: np.ndarray) -> tuple[float, float]:  # (log-likelihood, flip) for p = flip*w
            p = np.clip(np.minimum(_FLIPS[:, None] * w[None], _MAX_FLIP), 1e-12, None)
            ll = (k * np.log(p) + (n - k) * np.log1p(-p)).sum(1)
            i = int(np.argmax(ll))
            return float(ll[i]), float(_FLIPS[i])

        ll, flip = best(np.ones_like(g))
        fits = [(*best(_tail(g / s)), float(s)) for s in _SCALES]
        ll_s, flip_s, scale = max(fits)
        if ll_s > ll + _SCALE_EVIDENCE:
            return cls(flip_s, scale)
        return cls(flip)

    @classmethod
    def from_samples(cls, samples: np.ndarray) -> SwapModel:
        """Fitted on the consecutive rows of one layer's [intervals, experts] counts."""
        stats = [swap_counts(a, b) for a, b in zip(samples[:-1], samples[1:], strict=True)]
        if not stats:
            return cls()
        return cls.fit(*(np.sum(s, 0) for s in zip(*stats, strict=True)))


def swap_counts(before: np.ndarray, after: np.ndarray) -> tuple[np.ndarray, ...]:
    """(trials, flips, gap sum) per GAP_EDGES bin between two consecutive count vectors: pairs
    adjacent in `before`'s order whose gap is beyond count noise, and those of them whose order
    is reversed in `after` (raw counts: Poisson noise assumed)."""
    bins = len(GAP_EDGES) - 1
    trials, flips, gap_sum = np.zeros(bins), np.zeros(bins), np.zeros(bins)
    ta, tb = float(before.sum()), float(after.sum())
    if ta <= 0 or tb <= 0 or len(before) < 2:
        return trials, flips, gap_sum
    xa, xb = before / ta, after / tb
    va, vb = np.maximum(before, 1) / ta**2, np.maximum(after, 1) / tb**2
    order = np.argsort(-xa, kind="stable")
    hi, lo = order[:-1], order[1:]
    ok = xa[hi] - xa[lo] > _Z * np.sqrt(va[hi] + va[lo])
    flipped = ok & (xb[lo] - xb[hi] > _Z_FLIP * np.sqrt(vb[hi] + vb[lo]))
    g = np.log(np.maximum(xa[hi], 1e-300) / np.maximum(xa[lo], 1e-300))
    b = np.clip(np.searchsorted(GAP_EDGES, g, side="right") - 1, 0, bins - 1)
    np.add.at(trials, b[ok], 1.0)
    np.add.at(flips, b[flipped], 1.0)
    np.add.at(gap_sum, b[ok], g[ok])
    return trials, flips, gap_sum


def recent_load(samples: np.ndarray, half_life: float = 0.0) -> np.ndarray:
    """One layer's current load from its [intervals, experts] counts: the latest interval
    with any load (half_life 0), or every interval weighted 0.5 ** (age / half_life)."""
    samples = np.asarray(samples, dtype=np.float64)
    if half_life > 0:
        age = np.arange(len(samples))[::-1]
        return (0.5 ** (age / half_life)) @ samples
    busy = np.flatnonzero(samples.sum(1) > 0)
    return samples[busy[-1]] if len(busy) else samples[-1]


def drift_scenarios(
    load: np.ndarray, model: SwapModel, horizon: float, num: int, seed: int = 0
) -> np.ndarray:
    """[num, experts]: `load` after drifting per `model`; scenario m looks 0.5 + horizon *
    (m + 0.5) / num stats intervals ahead (the latest sample's middle to the end of the next
    rebalance period, evenly). Common random numbers: every call with the same seed draws the
    same unit-rate swap events, so a slightly different rate or order changes only a few."""
    n = len(load)
    out = np.empty((num, n))
    order = np.argsort(-load, kind="stable")
    curve = load[order]
    rates = model.swap_rates(curve) if n > 1 else np.zeros(0)
    total = float(rates.sum())
    if total <= 0 or num <= 0:
        out[:] = load
        return out
    expected = total * (0.5 + horizon * (np.arange(num) + 0.5) / num)
    cap = math.ceil(expected.max() + 6 * math.sqrt(expected.max()) + 10)
    # event t of every scenario comes from the same draws whatever cap is: streams of their own,
    # event-major
    times = np.cumsum(np.random.default_rng([seed, 0]).exponential(size=(cap, num)).T, 1)
    u = np.random.default_rng([seed, 1]).random((cap, num)).T
    pos = np.minimum(np.searchsorted(np.cumsum(rates) / total, u), n - 2)
    orders = np.tile(order, (num, 1))
    rows = np.arange(num)
    for t in range(cap):
        act = rows[times[:, t] <= expected]
        if not len(act):
            break
        i = pos[act, t]
        orders[act, i], orders[act, i + 1] = orders[act, i + 1], orders[act, i]
    np.put_along_axis(out, orders, np.broadcast_to(curve, (num, n)), 1)
    return out


class LoadWindow:
    def __init__(self, window: int = 10, drift_memory: float = 100.0) -> None:
        """drift_memory: swap statistics fade by 1 - 1/drift_memory per interval."""
        if window < 1:
            raise ValueError("the load window needs at least one interval")
        self.intervals: deque[torch.Tensor] = deque(maxlen=window)
        self.drift_memory = drift_memory
        self._swaps: np.ndarray | None = None  # [layers, 3 (trials, flips, gap sum), bins]

    def add(self, counts: torch.Tensor) -> None:
        """counts: [layers, experts] routed (token, expert) pairs of one interval."""
        counts = counts.detach().to("cpu", torch.float64)
        if self.intervals and self.intervals[-1].shape == counts.shape:
            before, after = self.intervals[-1].numpy(), counts.numpy()
            new = np.stack(
                [np.stack(swap_counts(a, b)) for a, b in zip(before, after, strict=True)]
            )
            if self._swaps is None or self._swaps.shape != new.shape:
                self._swaps = np.zeros_like(new)
            self._swaps = self._swaps * (1 - 1 / self.drift_memory) + new
        self.intervals.append(counts)

    def total(self) -> torch.Tensor | None:
        """[layers, experts] summed over the window; None before the first interval."""
        return torch.stack(list(self.intervals)).sum(0) if self.intervals else None

    def samples(self, layer: int) -> np.ndarray:
        """[intervals, experts] counts of one layer, oldest first."""
        return np.stack([c[layer].numpy() for c in self.intervals])

    def swap_model(self, layer: int) -> SwapModel:
        """The drift of one layer, fitted on every interval seen (fading), not just the
        window's."""
        if self._swaps is None:
            return SwapModel()
        return SwapModel.fit(*self._swaps[layer])


def _tail(x: np.ndarray) -> np.ndarray:
    """2 * Phi(-x), the two-sided normal tail (1 at x = 0, 1 everywhere for x = 0 / inf)."""
    return np.vectorize(math.erfc, otypes=[float])(np.asarray(x, dtype=np.float64) / math.sqrt(2))
