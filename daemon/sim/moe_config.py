"""A simulated MoE node's settings (`deepinfer simulate`'s MoE flags): torch-free, for the command
line's imports; sim/moe.py runs them."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.build.config import EngineConfig

# the MoE layers' part of a step's cost-table time when not given: the table measures whole
# steps (no MoE share), and a MoE model's expert FFNs are typically about half of its forward
DEFAULT_SHARE = 0.5


@dataclass
class MoEConfig:
    experts: int = 64
    experts_per_token: int = 8
    ranks: int = 8  # expert-parallel ranks
    slots_per_rank: int = 0  # 0: the daemon's default (every expert once, one spare a rank)
    layers: int = 1  # MoE layers simulated: each its own popularity order and placement
    zipf: float = 1.0  # the i-th most popular expert's router weight ~ 1 / i**zipf (0: uniform)
    drift: float = 0.0  # expected swaps of two experts adjacent in popularity, per step
    share: float = DEFAULT_SHARE  # of a step's table time, the MoE part the imbalance stretches
    stats_interval: int = EngineConfig.moe_stats_interval
    rebalance_interval: int = EngineConfig.moe_rebalance_interval  # 0: placement off
    window: int = EngineConfig.moe_stats_window
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError("experts per token must be in [1, experts]")
        if self.ranks < 1 or self.layers < 1 or self.window < 1:
            raise ValueError("MoE ranks, layers and window must be at least 1")
        if not 0 <= self.share <= 1 or self.zipf < 0 or self.drift < 0:
            raise ValueError("MoE share must be in [0, 1], zipf and drift >= 0")
        if self.slots_per_rank < 0 or 0 < self.slots_per_rank < -(-self.experts // self.ranks):
            raise ValueError(f"{self.experts} experts do not fit {self.ranks} ranks' slots")
        if self.stats_interval < 1 or self.rebalance_interval < 0:
            raise ValueError("MoE stats interval must be >= 1, rebalance interval >= 0")
