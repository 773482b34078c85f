"""DeepSeek's EPLB (github.com/deepseek-ai/EPLB, eplb.py), re-implemented from its description
for one layer, as the reference our balanced placement is measured against."""

from __future__ import annotations

import numpy as np

from daemon.moe.placement import Load, Placement, as_load


def eplb_placement(
    load: Load,
    num_ranks: int,
    slots_per_rank: int,
    num_groups: int,
    num_nodes: int,
) -> Placement:
    """EPLB's entry point: the hierarchical policy when the expert groups divide evenly among
    the nodes, else the global one."""
    if num_groups % num_nodes == 0:
        return eplb_hierarchical(load, num_ranks, slots_per_rank, num_groups, num_nodes)
    return eplb_global(load, num_ranks, slots_per_rank)


def eplb_global(load: Load, num_ranks: int, slots_per_rank: int) -> Placement:
    """Groups and nodes ignored: replicate over the whole cluster, pack onto all ranks."""
    return eplb_hierarchical(load, num_ranks, slots_per_rank, num_groups=1, num_nodes=1)


def eplb_hierarchical(
    load: Load,
    num_ranks: int,
    slots_per_rank: int,
    num_groups: int,
    num_nodes: int,
) -> Placement:
    """1. pack the contiguous expert groups onto nodes (equal group count per node) by group
    load; 2. replicate experts within each node into that node's slots; 3. pack each node's
    replicas onto its ranks (equal slot count per rank) by load per replica."""
    w = as_load(load)
    num_experts = len(w)
    if num_experts % num_groups or num_groups % num_nodes or num_ranks % num_nodes:
        raise ValueError(
            f"{num_experts} experts / {num_groups} groups / {num_nodes} nodes / "
            f"{num_ranks} ranks do not divide evenly"
        )
    group_size = num_experts // num_groups
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = ranks_per_node * slots_per_rank
    if slots_per_node * num_nodes < num_experts or slots_per_node < num_experts // num_nodes:
        raise ValueError("fewer slots per node than experts per node")

    group_node = _pack(w.reshape(num_groups, group_size).sum(1), num_nodes)
    phys = np.empty(num_ranks * slots_per_rank, dtype=np.int64)
    for node in range(num_nodes):
        groups = np.flatnonzero(group_node == node)
        experts = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        replica_of, counts = _replicate(w[experts], slots_per_node)
        weight = w[experts][replica_of] / counts[replica_of]
        rank = _pack(weight, ranks_per_node)
        # grouped by rank, heaviest first within a rank (EPLB's rank_in_pack order)
        order = _heaviest_first(weight)
        order = order[np.argsort(rank[order], kind="stable")]
        base = node * slots_per_node
        phys[base : base + slots_per_node] = experts[replica_of[order]]
    return Placement(num_ranks, slots_per_rank, phys.tolist())


def _replicate(load: np.ndarray, num_phys: int) -> tuple[np.ndarray, np.ndarray]:
    """(expert of each physical replica, replicas per expert): one replica each, then each
    extra one to the expert with the largest load per replica."""
    counts = np.ones(len(load), dtype=np.int64)
    replica_of = list(range(len(load)))
    for _ in range(num_phys - len(load)):
        e = int(np.argmax(load / counts))
        replica_of.append(e)
        counts[e] += 1
    return np.asarray(replica_of, dtype=np.int64), counts


def _pack(weights: np.ndarray, num_packs: int) -> np.ndarray:
    """Pack index of each item: heaviest first into the lightest pack that still has room,
    every pack taking exactly len(weights) / num_packs items."""
    if len(weights) % num_packs:
        raise ValueError(f"{len(weights)} items do not split into {num_packs} equal packs")
    per_pack = len(weights) // num_packs
    pack = np.full(len(weights), -1, dtype=np.int64)
    totals = np.zeros(num_packs)
    sizes = np.zeros(num_packs, dtype=np.int64)
    for i in _heaviest_first(weights):
        p = int(np.argmin(np.where(sizes < per_pack, totals, np.inf)))
        pack[i] = p
        totals[p] += weights[i]
        sizes[p] += 1
    return pack


def _heaviest_first(weights: np.ndarray) -> np.ndarray:
    return np.argsort(-weights, kind="stable")
