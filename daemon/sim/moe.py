"""A simulated MoE node's expert parallelism: each step's tokens routed to experts by a seeded
Zipf popularity (optionally drifting), the daemon's load statistics, schedule and placement
code (moe/controller.py), and the step's MoE time stretched by its busiest rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache

import numpy as np
import torch

from daemon.moe import controller
from daemon.moe.placement import (
    Placement,
    balanced_placement,
    imbalance,
    moved_slots,
    rank_share,
)
from daemon.moe.stats import LoadWindow
from daemon.sim.moe_config import MoEConfig

_INCLUSION_SAMPLES = 8192  # tokens of the Monte Carlo estimate of top-k inclusion


@dataclass
class Draw:
    """One step's routing, not yet taken: [layers, experts] (token, expert) pairs, the
    popularity order after the step's drift, each layer's max / mean rank load, and the
    step's seconds: the table's (`base`), its MoE part waiting for each layer's busiest rank."""

    counts: np.ndarray
    order: np.ndarray
    imbalance: float  # averaged over the layers
    base: float
    seconds: float


@dataclass
class MoECounters:
    steps: int = 0
    rebalances: int = 0
    moved_slots: int = 0
    stretch_s: float = 0.0  # seconds the imbalance added
    # the steps' imbalances (max / mean rank load, averaged over layers) summed, and the
    # steps, before the first rebalance and after it
    imbalance_sum_before: float = 0.0
    steps_before: int = 0
    imbalance_sum_after: float = 0.0
    steps_after: int = 0
    # each rebalance: its step and the window load's imbalance under the old and new placement
    log: list[dict] = field(default_factory=list)


class SimExperts:
    """The node's MoE layers as the daemon's MoEController sees them: per-step loads summed
    into a LoadWindow every stats interval, and `controller.replan` every rebalance interval
    (with more than one rank, as the daemon). A step's draws depend only on the seed, the
    node and the step's number, so a step drawn and not taken draws the same again."""

    def __init__(self, cfg: MoEConfig, node: int = 0) -> None:
        self.cfg, self.node = cfg, node
        e, r = cfg.experts, cfg.ranks
        self.slots_per_rank = cfg.slots_per_rank or controller.default_slots_per_rank(e, r)
        # as the controller starts: balanced for an even load
        self.placements = [
            balanced_placement(np.ones(e), r, self.slots_per_rank) for _ in range(cfg.layers)
        ]
        self._shares = [rank_share(p, e) for p in self.placements]
        self.window = LoadWindow(cfg.window)
        self.pending = np.zeros((cfg.layers, e))  # since the last collect (Layer.take_load)
        rng = np.random.default_rng([cfg.seed, 0])  # one model: every node's popularity alike
        self.order = np.stack([rng.permutation(e) for _ in range(cfg.layers)])  # by popularity
        self.inclusion = _inclusion(e, cfg.experts_per_token, cfg.zipf)
        self.counters = MoECounters()

    def draw(self, tokens: int, seconds: float) -> Draw:
        """The next step's routing of `tokens` tokens, its table time `seconds`: each expert
        gets each token with its top-k inclusion probability (k pairs a token on average)."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 1, self.node, self.counters.steps + 1])
        order = self.order
        if cfg.drift > 0 and cfg.experts > 1:
            order = order.copy()
            for layer in order:
                for i in rng.integers(0, cfg.experts - 1, rng.poisson(cfg.drift)):
                    layer[i], layer[i + 1] = layer[i + 1], layer[i]
        q = np.empty(order.shape)
        np.put_along_axis(q, order, np.broadcast_to(self.inclusion, order.shape), 1)
        counts = rng.binomial(tokens, q).astype(np.float64)
        ratios = []
        for c, share in zip(counts, self._shares, strict=True):
            loads = c @ share
            mean = loads.mean()
            ratios.append(float(loads.max() / mean) if mean > 0 else 1.0)
        mean = float(np.mean(ratios))
        return Draw(counts, order, mean, seconds, seconds * (1 - cfg.share + cfg.share * mean))

    def take(self, draw: Draw) -> None:
        """The step runs as drawn; then the daemon's statistics and placement schedule."""
        cfg, c = self.cfg, self.counters
        c.stretch_s += draw.seconds - draw.base
        if c.rebalances:
            c.imbalance_sum_after += draw.imbalance
            c.steps_after += 1
        else:
            c.imbalance_sum_before += draw.imbalance
            c.steps_before += 1
        self.order = draw.order
        self.pending += draw.counts
        c.steps += 1
        decisions = controller.decide(c.steps, cfg.stats_interval, cfg.rebalance_interval)
        if decisions.collect:
            self.window.add(torch.from_numpy(self.pending))
            self.pending = np.zeros_like(self.pending)
        if decisions.rebalance and cfg.ranks > 1:
            self._rebalance()

    def _rebalance(self) -> None:
        c = self.counters
        load = self.window.total()
        assert load is not None  # collected just now
        old = self.placements
        new = controller.replan(
            self.window, old, self.slots_per_rank, self.cfg.stats_interval,
            self.cfg.rebalance_interval,
        )  # fmt: skip
        moved = sum(moved_slots(a, b) for a, b in zip(old, new, strict=True))
        c.log.append(
            {
                "step": c.steps,
                "imbalance_before": _mean_imbalance(old, load),
                "imbalance_after": _mean_imbalance(new, load),
                "moved_slots": moved,
            }
        )
        c.rebalances += 1
        c.moved_slots += moved
        self.placements = new
        self._shares = [rank_share(p, self.cfg.experts) for p in new]

    def summary(self) -> dict:
        return asdict(self.counters)


def _mean_imbalance(placements: list[Placement], load: torch.Tensor) -> float:
    return float(np.mean([imbalance(p, load[i].numpy()) for i, p in enumerate(placements)]))


@lru_cache(maxsize=16)
def _inclusion(experts: int, k: int, zipf: float) -> np.ndarray:
    """P(a token routes to the i-th most popular expert) when each token takes k distinct
    experts, drawn without replacement by router weight 1 / i**zipf (Gumbel top-k); a
    fixed-seed estimate, scaled to add up to exactly k."""
    if k == experts:
        return np.ones(experts)
    logw = -zipf * np.log(np.arange(1, experts + 1))
    rng = np.random.default_rng(0)
    keys = logw + rng.gumbel(size=(_INCLUSION_SAMPLES, experts))
    top = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    q = np.bincount(top.reshape(-1), minlength=experts) / _INCLUSION_SAMPLES
    q = np.maximum(q, 0.5 / _INCLUSION_SAMPLES)
    return np.minimum(q * k / q.sum(), 1.0)
