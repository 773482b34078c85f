"""Where each MoE expert lives under expert parallelism: physical slots on ranks, hot-expert
replicas, the token split among replicas, and the static / balanced placement policies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from daemon.moe import packing
from daemon.moe.packing import EMPTY
from daemon.moe.stats import SwapModel, drift_scenarios, recent_load

Load = Sequence[float] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class Placement:
    """One MoE layer: physical slot p holds logical expert phys_to_logical[p] (EMPTY = unused)
    and lives on rank p // slots_per_rank."""

    num_ranks: int
    slots_per_rank: int
    phys_to_logical: list[int]
    _tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def num_slots(self) -> int:
        return self.num_ranks * self.slots_per_rank

    def rank_of(self, phys: int) -> int:
        return phys // self.slots_per_rank

    @cached_property
    def num_experts(self) -> int:
        """Highest expert id placed, plus one."""
        return max(self.phys_to_logical, default=EMPTY) + 1

    @cached_property
    def logical_to_phys(self) -> list[list[int]]:
        """The physical slots (replicas) of each expert, in slot order."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(self.phys_to_logical):
            if e != EMPTY:
                out[e].append(p)
        return out

    @cached_property
    def replica_counts(self) -> list[int]:
        return [len(r) for r in self.logical_to_phys]

    def table(self) -> np.ndarray:
        """[num_ranks, slots_per_rank] logical expert ids."""
        return np.asarray(self.phys_to_logical, dtype=np.int64).reshape(
            self.num_ranks, self.slots_per_rank
        )

    def validate(self, num_experts: int) -> None:
        """Raises ValueError unless the slot count matches and every expert id in
        [0, num_experts) is placed at least once (so EMPTY slots only exist when the
        slots outnumber the experts)."""
        if self.num_ranks <= 0 or self.slots_per_rank <= 0:
            raise ValueError(f"bad shape {self.num_ranks} ranks x {self.slots_per_rank} slots")
        if len(self.phys_to_logical) != self.num_slots:
            raise ValueError(f"{len(self.phys_to_logical)} slots, expected {self.num_slots}")
        bad = [e for e in self.phys_to_logical if e != EMPTY and not 0 <= e < num_experts]
        if bad:
            raise ValueError(f"expert ids out of range [0, {num_experts}): {sorted(set(bad))[:8]}")
        placed = {e for e in self.phys_to_logical if e != EMPTY}
        if len(placed) != num_experts:
            missing = sorted(set(range(num_experts)) - placed)
            raise ValueError(f"{len(missing)} experts not placed, e.g. {missing[:8]}")

    def replica_table(
        self, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [E, max_replicas] of physical ids padded with EMPTY, counts [E]) on `device`."""
        device = torch.device(device)
        if device not in self._tables:
            phys = self.logical_to_phys
            width = max((len(r) for r in phys), default=1)
            table = torch.full((len(phys), width), EMPTY, dtype=torch.long)
            for e, reps in enumerate(phys):
                table[e, : len(reps)] = torch.tensor(reps, dtype=torch.long)
            counts = torch.tensor([len(r) for r in phys], dtype=torch.long)
            self._tables[device] = (table.to(device), counts.to(device))
        return self._tables[device]

    def choose_replicas(
        self, expert_ids: torch.Tensor, token_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Physical slot for each (token, expert) pair: replica token_index % replica_count of
        the expert. Without token_index each pair's arrival order among the pairs routed to the
        same expert is used, which splits every expert's tokens among its replicas within one."""
        table, counts = self.replica_table(expert_ids.device)
        if token_index is None:
            token_index = arrival_index(expert_ids, len(counts))
        replica = token_index % counts[expert_ids]
        return table[expert_ids, replica]


def arrival_index(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each entry, how many earlier entries (in flattened order) carry the same expert."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return pos.reshape(expert_ids.shape)


@dataclass
class ExpertPlacement:
    """The placements of all MoE layers of a model."""

    layers: list[Placement]

    def validate(self, num_experts: int) -> None:
        for i, layer in enumerate(self.layers):
            try:
                layer.validate(num_experts)
            except ValueError as e:
                raise ValueError(f"layer {i}: {e}") from None

    def moved_slots(self, previous: ExpertPlacement) -> int:
        return sum(moved_slots(p, n) for p, n in zip(previous.layers, self.layers, strict=True))


def static_placement(num_experts: int, num_ranks: int, slots_per_rank: int) -> Placement:
    """No replicas: experts laid out contiguously, rank r holding experts
    [r*E//R, (r+1)*E//R); the remaining slots stay EMPTY."""
    if -(-num_experts // num_ranks) > slots_per_rank:
        raise ValueError(f"{num_experts} experts do not fit {num_ranks} x {slots_per_rank} slots")
    table = np.full((num_ranks, slots_per_rank), EMPTY, dtype=np.int64)
    for r in range(num_ranks):
        experts = range(r * num_experts // num_ranks, (r + 1) * num_experts // num_ranks)
        table[r, : len(experts)] = experts
    return _from_table(table)


def balanced_placement(
    load: Load,
    num_ranks: int,
    slots_per_rank: int,
    previous: Placement | None = None,
    *,
    keep_tolerance: float = 0.01,
    duplicate_threshold: float = 0.01,
) -> Placement:
    """Replicate hot experts into the spare slots, pack the replicas onto ranks largest first,
    then swap replicas off the busiest rank while that lowers it; a rank only gets a second
    replica of an expert if the busiest rank would otherwise stay more than
    `duplicate_threshold` above the mean. With `previous`, that result is relabelled to keep
    what it can in place, and a second candidate starts from the previous layout (replica
    counts updated) and swaps only until its busiest rank is within `keep_tolerance` of the
    first's; the candidate that moves fewer slots wins."""
    w = as_load(load)
    if -(-len(w) // num_ranks) > slots_per_rank:
        raise ValueError(f"{len(w)} experts do not fit {num_ranks} x {slots_per_rank} slots")
    counts = packing.replica_counts(w, num_ranks * slots_per_rank, max_per_expert=num_ranks)
    per_replica = w / counts
    mean = w.sum() / num_ranks
    dup_above = mean * (1 + duplicate_threshold)
    table = packing.greedy_pack(per_replica, counts, num_ranks, slots_per_rank)
    table = packing.balance(table, per_replica, 0.0, dup_above)
    if previous is not None:
        prev = previous.table()
        if prev.shape != table.shape:
            raise ValueError(f"previous placement has shape {prev.shape}, expected {table.shape}")
        table = packing.align(table, prev)
        target = packing.max_load(table, per_replica) * (1 + keep_tolerance)
        warm = packing.warm_start(prev, counts, per_replica)
        warm = packing.balance(warm, per_replica, target, dup_above)
        if packing.max_load(warm, per_replica) <= target and packing.moved(
            warm, prev
        ) <= packing.moved(table, prev):
            table = warm
    return _from_table(table)


def robust_placement(
    samples: np.ndarray | torch.Tensor,
    num_ranks: int,
    slots_per_rank: int,
    previous: Placement | None = None,
    *,
    drift: SwapModel | None = None,
    horizon: float = 10.0,
    scenarios: int = 32,
    sharpness: float = 60.0,
    move_cost: float = 5e-5,
    half_life: float = 0.0,
    fallback_tolerance: float = 0.01,
    duplicate_threshold: float = 0.01,
    seed: int = 0,
) -> Placement:
    """A placement for the next `horizon` stats intervals of drift, not for the past.

    samples: one layer's [intervals, experts] raw counts, oldest first (the load window).
    The current load is `recent_load(samples, half_life)` (the latest interval by default);
    `drift` (default: fitted on the samples; `LoadWindow.swap_model` remembers longer) turns it
    into `scenarios` futures spread over the horizon (`drift_scenarios`). Every expert gets
    replicas for its largest load over the scenarios (an expert that may overtake the one
    above it is replicated as if it had), and the replicas are placed by a swap search on the
    expected soft maximum of the rank loads over the scenarios (`packing.scenario_search`;
    `sharpness` ~ 1.3 / the per-step relative noise of a rank's load, so the soft maximum is
    the expected busiest rank of a noisy step). With `previous`, the search starts from it
    (replica counts updated) and a swap must gain `move_cost` (in rank-mean units) per slot it
    moves; if that ends more than `fallback_tolerance` above a fresh nominal packing, a fresh
    searched placement relabelled onto `previous` is taken if it is better. Without drift
    (all scenarios equal) this is the nominal balance of the latest load."""
    x = samples.detach().cpu().double().numpy() if isinstance(samples, torch.Tensor) else samples
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or not len(x):
        raise ValueError(f"samples must be [intervals, experts] with an interval, got {x.shape}")
    if (x < 0).any() or not np.isfinite(x).all():
        raise ValueError("expert loads must be finite and non-negative")
    w = as_load(recent_load(x, half_life))
    n = len(w)
    if -(-n // num_ranks) > slots_per_rank:
        raise ValueError(f"{n} experts do not fit {num_ranks} x {slots_per_rank} slots")
    model = SwapModel.from_samples(x) if drift is None else drift
    nominal = w / w.sum() * num_ranks  # rank mean 1
    futures = drift_scenarios(nominal, model, horizon, scenarios, seed)
    counts = packing.replica_counts(
        futures.max(0), num_ranks * slots_per_rank, max_per_expert=num_ranks
    )
    per_replica = nominal / counts
    per_future = futures / counts
    fresh = packing.greedy_pack(per_replica, counts, num_ranks, slots_per_rank)
    fresh = packing.balance(fresh, per_replica, 0.0, 1 + duplicate_threshold)
    if previous is None:
        return _from_table(packing.scenario_search(fresh, per_future, sharpness))
    prev = previous.table()
    if prev.shape != fresh.shape:
        raise ValueError(f"previous placement has shape {prev.shape}, expected {fresh.shape}")
    table = packing.warm_start(prev, counts, per_replica)
    table = packing.scenario_search(table, per_future, sharpness, prev, move_cost)
    value = packing.soft_max_load(table, per_future, sharpness)
    if value > packing.soft_max_load(fresh, per_future, sharpness) + fallback_tolerance:
        fresh = packing.align(packing.scenario_search(fresh, per_future, sharpness), prev)
        if packing.soft_max_load(fresh, per_future, sharpness) < value:
            table = fresh
    return _from_table(table)


def hot_replica_placement(load: Load, residents: Placement) -> Placement:
    """The residents' filled slots stay put; their EMPTY slots take replicas of the hottest
    experts, packed and swapped among those slots only (at most one move per spare slot)."""
    w = as_load(load)
    base = residents.table()
    counts = packing.replica_counts(w, base.size, max_per_expert=residents.num_ranks)
    per_replica = w / counts
    table = packing.warm_start(base, counts, per_replica)
    table = packing.local_search(table, per_replica, movable=base == EMPTY)
    return _from_table(table)


def moved_slots(previous: Placement, new: Placement) -> int:
    """Slots that must load new expert weights: filled in `new` with a different expert."""
    return packing.moved(new.table(), previous.table())


def rank_share(placement: Placement, num_experts: int | None = None) -> np.ndarray:
    """[E, R]: the fraction of expert e's tokens that rank r serves (tokens split evenly
    among replicas)."""
    n = placement.num_experts if num_experts is None else num_experts
    share = np.zeros((n, placement.num_ranks))
    counts = placement.replica_counts
    for p, e in enumerate(placement.phys_to_logical):
        if e != EMPTY:
            share[e, placement.rank_of(p)] += 1.0 / counts[e]
    return share


def rank_loads(placement: Placement, load: Load) -> list[float]:
    """Load of each rank when every expert's load is split evenly among its replicas."""
    w = as_load(load)
    return (w @ rank_share(placement, len(w))).tolist()


def imbalance(placement: Placement, load: Load) -> float:
    """max / mean of the rank loads (1.0 = perfectly balanced)."""
    loads = rank_loads(placement, load)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def as_load(load: Load) -> np.ndarray:
    """Expert loads as a float64 vector; all zeros count as uniform."""
    if isinstance(load, torch.Tensor):
        load = load.detach().cpu().double().numpy()
    w = np.asarray(load, dtype=np.float64).reshape(-1)
    if (w < 0).any() or not np.isfinite(w).all():
        raise ValueError("expert loads must be finite and non-negative")
    return w if w.sum() > 0 else np.ones_like(w)


def _from_table(table: np.ndarray) -> Placement:
    return Placement(int(table.shape[0]), int(table.shape[1]), table.reshape(-1).tolist())
