"""Expert load statistics: per-layer token counts taken every `stats_interval` steps into a
moving window of the last `window` intervals."""

from __future__ import annotations

from collections import deque

import torch


class LoadWindow:
    def __init__(self, window: int = 10) -> None:
        if window < 1:
            raise ValueError("the load window needs at least one interval")
        self.intervals: deque[torch.Tensor] = deque(maxlen=window)

    def add(self, counts: torch.Tensor) -> None:
        """counts: [layers, experts] routed (token, expert) pairs of one interval."""
        self.intervals.append(counts.detach().to("cpu", torch.float64))

    def total(self) -> torch.Tensor | None:
        """[layers, experts] summed over the window; None before the first interval."""
        return torch.stack(list(self.intervals)).sum(0) if self.intervals else None

    def resize(self, window: int) -> None:
        self.intervals = deque(self.intervals, maxlen=window)
