"""What the administration endpoints and a settings reload use of a MoE model's controller
(moe.controller.MoEController): Engine.moe is one, or None for a model without MoE layers."""

from __future__ import annotations

from typing import Protocol

from daemon.moe.ep import EPGroup


class MoEControl(Protocol):
    ep: EPGroup | None  # the expert-parallel group, None on one process
    version: int  # placements applied so far
    stats_interval: int
    rebalance_interval: int

    def status(self) -> dict: ...
    def expert_load(self) -> dict: ...
    def request_rebalance(self) -> None:
        """Ask for a rebalance at the next step boundary (from any thread)."""
        ...

    def set_intervals(self, stats: int | None, rebalance: int | None) -> None: ...
