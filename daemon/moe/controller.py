"""Runs the MoE layers' expert parallelism: load statistics, placement, live rebalancing.

Everything here runs on the device worker between steps. Under expert parallelism every rank
calls `after_step` after the same step with the same `decisions`, so the collectives line up:
statistics are summed over ranks, rank 0's placement is broadcast, and expert weights move
before the next step, which therefore runs entirely on the new placement.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import structlog
import torch
import torch.distributed as dist

from daemon.moe.ep import EPGroup, EPLayer, ExpertSlots
from daemon.moe.placement import (
    EMPTY,
    Placement,
    balanced_placement,
    imbalance,
    rank_loads,
    robust_placement,
)
from daemon.moe.stats import LoadWindow
from daemon.moe.weights import move_expert_weights

log = structlog.get_logger(__name__)


@dataclass
class Decisions:
    """What the whole group does after this step (rank 0 decides the schedule)."""

    collect: bool = False
    rebalance: bool = False


def default_slots_per_rank(num_experts: int, ranks: int) -> int:
    """Every expert once and, under expert parallelism, a spare slot a rank for hot replicas."""
    return math.ceil(num_experts / ranks) + (ranks > 1)


def decide(step: int, stats_interval: int, rebalance_interval: int) -> Decisions:
    """What the schedule asks for after forward number `step` (from 1): the load is collected
    every `stats_interval` steps, and placed anew every `rebalance_interval` (0: never)."""
    rebalance = rebalance_interval > 0 and step % rebalance_interval == 0
    collect = rebalance or (stats_interval > 0 and step % stats_interval == 0)
    return Decisions(collect, rebalance)


def replan(
    window: LoadWindow,
    placements: list[Placement],
    slots_per_rank: int,
    stats_interval: int,
    rebalance_interval: int,
) -> list[Placement]:
    """Every layer's next placement from the window's load (same ranks as before), hedged
    against the drift the window has seen until the next rebalance."""
    every, sampled = rebalance_interval, stats_interval
    horizon = every / sampled if every and sampled else 1.0
    return [
        robust_placement(
            window.samples(i),
            old.num_ranks,
            slots_per_rank,
            old,
            drift=window.swap_model(i),
            horizon=horizon,
        )
        for i, old in enumerate(placements)
    ]


class MoEController:
    def __init__(
        self,
        layers: list,  # the model's MoE modules, in forward order
        ep: EPGroup | None,
        slots_per_rank: int = 0,
        stats_interval: int = 1000,
        rebalance_interval: int = 10000,
        window: int = 10,
    ) -> None:
        self.layers, self.ep = layers, ep
        self.num_experts = layers[0].num_experts
        ranks = ep.size if ep else 1
        self.slots_per_rank = slots_per_rank or default_slots_per_rank(self.num_experts, ranks)
        self.window = LoadWindow(window)
        self.steps = 0
        self.version = 0  # placements applied so far
        self.last_rebalance: dict[str, float] | None = None
        self._rebalance_requested = threading.Event()
        self.set_intervals(stats_interval, rebalance_interval)  # (and load tracking)
        self.placements = [
            balanced_placement(np.ones(self.num_experts), ranks, self.slots_per_rank)
            for _ in layers
        ]
        if ep is not None:
            for layer, placement in zip(layers, self.placements):
                slots = ExpertSlots.take(
                    layer.gate_up_proj.data, layer.down_proj.data, placement, ep.rank
                )
                layer.ep = EPLayer(ep, placement, slots, layer.expert)
                layer.gate_up_proj = layer.down_proj = None  # only the slots stay

    # ---- requests from the event loop (any thread) ----------------------------------------

    def request_rebalance(self) -> None:
        self._rebalance_requested.set()

    def set_intervals(self, stats: int | None, rebalance: int | None) -> None:
        if stats is not None:
            self.stats_interval = stats
        if rebalance is not None:
            self.rebalance_interval = rebalance
        for layer in self.layers:
            layer.track_load = self.stats_interval > 0 or self.rebalance_interval > 0

    # ---- worker ------------------------------------------------------------------------------

    def schedule(self) -> Decisions:
        """What this rank's intervals ask for after the next step (under EP rank 0's count)."""
        return decide(self.steps + 1, self.stats_interval, self.rebalance_interval)

    def rebalance_requested(self) -> bool:
        return self._rebalance_requested.is_set()

    def after_step(self, decisions: Decisions) -> None:
        self.steps += 1
        if decisions.collect:
            self._collect()
        if decisions.rebalance:
            self._rebalance_requested.clear()
            self._rebalance()

    def idle_step(self, hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        for layer in self.layers:
            layer.idle_step(hidden_size, device, dtype)

    def _collect(self) -> None:
        counts = torch.stack([layer.take_load().to(torch.float64) for layer in self.layers])
        if self.ep is not None:
            counts = counts.cpu()
            dist.all_reduce(counts, group=self.ep.control)
        self.window.add(counts)

    def _rebalance(self) -> None:
        load = self.window.total()
        if self.ep is None or self.ep.size == 1 or load is None:
            return
        start = time.perf_counter()
        placements = (
            replan(
                self.window,
                self.placements,
                self.slots_per_rank,
                self.stats_interval,
                self.rebalance_interval,
            )
            if self.ep.rank == 0  # rank 0 places, the others take its placement
            else self.placements
        )
        table = torch.tensor([p.phys_to_logical for p in placements], dtype=torch.long)
        dist.broadcast(table, 0, group=self.ep.control)
        moved = 0
        for i, layer in enumerate(self.layers):
            new = Placement(self.ep.size, self.slots_per_rank, table[i].tolist())
            moved += move_expert_weights(layer.ep, new)
            self.placements[i] = new
        self.version += 1
        seconds = time.perf_counter() - start
        after = [imbalance(p, load[i].numpy()) for i, p in enumerate(self.placements)]
        self.last_rebalance = {"seconds": seconds, "moved_slots": moved, "at_step": self.steps}
        log.info(
            "experts_rebalanced",
            version=self.version,
            moved_slots=moved,
            seconds=round(seconds, 4),
            imbalance=[round(x, 3) for x in after],
        )

    # ---- reports -----------------------------------------------------------------------------

    def expert_load(self) -> dict:
        """Per layer: expert loads over the window, per-rank loads, imbalance (max/mean)."""
        load = self.window.total()
        layers = []
        for i, placement in enumerate(self.placements):
            expert = load[i].numpy() if load is not None else np.zeros(self.num_experts)
            ranks = rank_loads(placement, expert) if expert.sum() else [0.0] * placement.num_ranks
            mean = sum(ranks) / len(ranks)
            layers.append(
                {
                    "layer": i,
                    "expert_load": expert.tolist(),
                    "rank_load": ranks,
                    "imbalance": max(ranks) / mean if mean else None,
                    "replicas": placement.replica_counts,
                    "slots": placement.phys_to_logical,
                }
            )
        return {"window_intervals": len(self.window.intervals), "layers": layers}

    def status(self) -> dict:
        return {
            "ep_rank": self.ep.rank if self.ep else 0,
            "ep_size": self.ep.size if self.ep else 1,
            "moe_layers": len(self.layers),
            "experts": self.num_experts,
            "slots_per_rank": self.slots_per_rank,
            "steps": self.steps,
            "stats_interval": self.stats_interval,
            "rebalance_interval": self.rebalance_interval,
            "placement_version": self.version,
            "last_rebalance": self.last_rebalance,
            "empty_slots": sum(p.phys_to_logical.count(EMPTY) for p in self.placements),
        }
