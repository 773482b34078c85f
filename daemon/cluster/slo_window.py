"""The router's recent latencies: each proxied stream's TTFT and TPOT with the time it ended,
kept for one window, read as p99s (nearest rank) for the autoscaling policy."""

from __future__ import annotations

import math
from collections import deque


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))]


class SloWindow:
    def __init__(self, window_s: float, max_samples: int = 100_000) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._samples: deque[tuple[float, float, float | None]] = deque(maxlen=max_samples)

    def add(self, now: float, ttft_s: float, tpot_s: float | None) -> None:
        self._samples.append((now, ttft_s, tpot_s))

    def read(self, now: float) -> tuple[float | None, float | None, int]:
        """(p99 TTFT, p99 TPOT, samples) over the last window; older samples are dropped."""
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        ttft = [s[1] for s in self._samples]
        tpot = [s[2] for s in self._samples if s[2] is not None]
        return p99(ttft), p99(tpot), len(ttft)
