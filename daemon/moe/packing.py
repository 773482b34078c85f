"""Array-level steps of the balanced placement: replica counts, greedy packing, swap search,
and keeping a previous layout. Tables are [ranks, slots] of expert ids, -1 = empty slot."""

from __future__ import annotations

import heapq

import numpy as np

EMPTY = -1
_EPS = 1e-12


def replica_counts(load: np.ndarray, num_slots: int, max_per_expert: int) -> np.ndarray:
    """Replicas per expert: one each, then every spare slot goes to the expert with the largest
    load per replica (at most max_per_expert: one per rank)."""
    n = len(load)
    counts = np.ones(n, dtype=np.int64)
    heap = [(-float(load[e]), e) for e in range(n)]
    heapq.heapify(heap)
    for _ in range(num_slots - n):
        while heap and counts[heap[0][1]] >= max_per_expert:
            heapq.heappop(heap)
        if not heap:
            break
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(load[e]) / counts[e], e))
    return counts


def greedy_pack(
    per_replica: np.ndarray, counts: np.ndarray, num_ranks: int, slots_per_rank: int
) -> np.ndarray:
    """Heaviest replica first onto the least-loaded rank with a free slot, preferring ranks
    that do not hold that expert yet."""
    experts = np.repeat(np.arange(len(counts)), counts)
    experts = experts[np.argsort(-per_replica[experts], kind="stable")]
    table = np.full((num_ranks, slots_per_rank), EMPTY, dtype=np.int64)
    loads = np.zeros(num_ranks)
    fill = np.zeros(num_ranks, dtype=np.int64)
    holds = np.zeros((num_ranks, len(counts)), dtype=bool)
    for e in experts:
        free = fill < slots_per_rank
        ok = free & ~holds[:, e]
        r = int(np.argmin(np.where(ok if ok.any() else free, loads, np.inf)))
        table[r, fill[r]] = e
        fill[r] += 1
        loads[r] += per_replica[e]
        holds[r, e] = True
    return table


def local_search(
    table: np.ndarray,
    per_replica: np.ndarray,
    target: float = 0.0,
    movable: np.ndarray | None = None,
    duplicates: bool = False,
    max_iters: int = 20_000,
) -> np.ndarray:
    """While the busiest rank is above `target`, apply the swap (or move into an empty slot)
    between it and any other rank that lowers the larger of the two loads the most; only
    `movable` slots ([ranks, slots] bool) take part, and unless `duplicates` no rank gets a
    second replica of an expert. Each swap strictly lowers the sum of squared loads, so this
    terminates."""
    table = table.copy()
    movable = np.ones(table.shape, dtype=bool) if movable is None else movable
    num_ranks, _ = table.shape
    n = len(per_replica)
    w = np.append(per_replica, 0.0)  # index -1 (empty) weighs nothing
    held = np.zeros((num_ranks, n + 1), dtype=np.int64)
    np.add.at(held, (np.arange(num_ranks)[:, None], table), 1)
    held[:, n] = 0  # empty slots never conflict
    slot_w = w[table]
    loads = slot_w.sum(1)
    for _ in range(max_iters):
        h = int(np.argmax(loads))
        top = loads[h]
        if top <= target:
            break
        d = slot_w[h][:, None, None] - slot_w[None]  # [slot i of h, rank k, slot j of k]
        pair_max = np.maximum(top - d, loads[None, :, None] + d)
        ok = (d > _EPS) & (pair_max < top - _EPS * max(top, 1.0))
        if not duplicates:
            ok &= held[:, table[h]].T[:, :, None] == 0  # expert of (h, i) not on k yet
            ok &= (held[h][table] == 0)[None]  # expert of (k, j) not on h yet
        ok &= movable[h][:, None, None] & movable[None]
        ok[:, h, :] = False
        if not ok.any():
            break
        i, k, j = np.unravel_index(int(np.argmin(np.where(ok, pair_max, np.inf))), ok.shape)
        a, b = int(table[h, i]), int(table[k, j])
        table[h, i], table[k, j] = b, a
        slot_w[h, i], slot_w[k, j] = w[b], w[a]
        held[h, a] -= 1
        held[k, a] += 1
        held[k, b] -= 1
        held[h, b] += 1
        held[:, n] = 0
        loads[h] -= d[i, k, j]
        loads[k] += d[i, k, j]
    return table


def balance(
    table: np.ndarray, per_replica: np.ndarray, target: float, duplicates_above: float
) -> np.ndarray:
    """local_search without duplicate replicas on a rank, then, only if the busiest rank is
    still above `duplicates_above`, with them (a second replica on a rank is a finer share of
    the expert's tokens, which very hot experts may need)."""
    table = local_search(table, per_replica, target)
    if max_load(table, per_replica) > max(target, duplicates_above):
        table = local_search(table, per_replica, target, duplicates=True)
    return table


def warm_start(previous: np.ndarray, counts: np.ndarray, per_replica: np.ndarray) -> np.ndarray:
    """The previous table with replica counts changed to `counts`: surplus replicas leave the
    busiest ranks, then missing ones (heaviest first) go to the least-loaded free slots."""
    table = previous.copy()
    table[table >= len(counts)] = EMPTY
    w = np.append(per_replica, 0.0)
    have = np.bincount(table[table >= 0], minlength=len(counts))
    loads = w[table].sum(1)
    for e in np.flatnonzero(have > counts):
        ranks, slots = np.nonzero(table == e)
        for k in np.argsort(-loads[ranks], kind="stable")[: have[e] - counts[e]]:
            table[ranks[k], slots[k]] = EMPTY
            loads[ranks[k]] -= w[e]
    need = np.flatnonzero(counts > have)
    missing = np.repeat(need, counts[need] - have[need])
    for e in missing[np.argsort(-per_replica[missing], kind="stable")]:
        free = (table == EMPTY).any(1)
        ok = free & ~(table == e).any(1)
        r = int(np.argmin(np.where(ok if ok.any() else free, loads, np.inf)))
        table[r, int(np.argmax(table[r] == EMPTY))] = e
        loads[r] += w[e]
    return table


def align(table: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """Relabel ranks (they are interchangeable for balance) and permute slots within each rank
    so that as many slots as possible keep the expert they held in `previous`."""
    num_ranks, slots = table.shape
    n = int(max(table.max(), previous.max())) + 1
    new_c = _rank_counts(table, n)
    old_c = _rank_counts(previous, n)
    overlap = np.minimum(new_c[:, None, :], old_c[None, :, :]).sum(-1)  # [new rank, old rank]
    order = np.argsort(-overlap, axis=None, kind="stable")
    target = np.full(num_ranks, -1, dtype=np.int64)
    taken = np.zeros(num_ranks, dtype=bool)
    for flat in order:
        b, r = divmod(int(flat), num_ranks)
        if target[b] < 0 and not taken[r]:
            target[b], taken[r] = r, True
    out = np.full_like(table, EMPTY)
    for b, r in enumerate(target):
        rest = list(table[b])
        row = [EMPTY] * slots
        for s, e in enumerate(previous[r]):
            if e != EMPTY and e in rest:
                rest.remove(e)
                row[s] = int(e)
        fill = iter(rest)
        out[r] = [e if e != EMPTY else next(fill) for e in row]
    return out


def moved(table: np.ndarray, previous: np.ndarray) -> int:
    """Slots that receive a different (non-empty) expert."""
    return int(((table != previous) & (table != EMPTY)).sum())


def max_load(table: np.ndarray, per_replica: np.ndarray) -> float:
    return float(np.append(per_replica, 0.0)[table].sum(1).max())


def _rank_counts(table: np.ndarray, n: int) -> np.ndarray:
    counts = np.zeros((table.shape[0], n + 1), dtype=np.int64)
    np.add.at(counts, (np.arange(table.shape[0])[:, None], table), 1)
    return counts[:, :n]


def soft_max_load(table: np.ndarray, per_replica: np.ndarray, sharpness: float) -> float:
    """Mean over scenarios of the soft maximum (1/sharpness) log sum_r exp(sharpness * load_r)
    of the rank loads; per_replica is [scenarios, experts]."""
    w = np.concatenate([per_replica, np.zeros((len(per_replica), 1))], 1)
    loads = w[:, table].sum(2)  # [scenarios, ranks]
    top = loads.max(1)
    lse = np.log(np.exp(sharpness * (loads - top[:, None])).sum(1)) / sharpness
    return float((top + lse).mean())


def scenario_search(
    table: np.ndarray,
    per_replica: np.ndarray,
    sharpness: float,
    previous: np.ndarray | None = None,
    move_cost: float = 0.0,
    max_iters: int = 5_000,
) -> np.ndarray:
    """Swap search on the expected soft max over load scenarios (`soft_max_load`).

    per_replica is [scenarios, experts]: the load of one replica of each expert in each
    scenario. Each iteration takes the rank with the largest share of the soft maxima and
    applies the swap (or move into an empty slot) with any other rank that lowers the objective
    the most; with `previous`, every slot the swap takes off or puts back on its previous expert
    adds or saves `move_cost`, so swaps that gain less than they move are not made. No rank gets
    a second replica of an expert. Each swap strictly lowers objective + move_cost * moved,
    so this terminates."""
    table = table.copy()
    num_scen, n = per_replica.shape
    num_ranks, _ = table.shape
    w = np.concatenate([per_replica, np.zeros((num_scen, 1))], 1)  # index -1 (empty): 0
    held = np.zeros((num_ranks, n + 1), dtype=np.int64)
    np.add.at(held, (np.arange(num_ranks)[:, None], table), 1)
    held[:, n] = 0
    slot_w = w[:, table]  # [scenarios, ranks, slots]
    loads = slot_w.sum(2)
    for _ in range(max_iters):
        ex = np.exp(sharpness * (loads - loads.max(1, keepdims=True)))
        z = ex.sum(1)  # [scenarios]
        h = int(np.argmax((ex / z[:, None]).mean(0)))
        # d[s, i, k, j]: load moving from rank h to rank k when (h, i) and (k, j) swap
        d = slot_w[:, h, :, None, None] - slot_w[:, None, :, :]
        x = np.exp(sharpness * d)
        eh = ex[:, h, None, None, None]
        ek = ex[:, None, :, None]
        z2 = z[:, None, None, None] - eh - ek + eh / x + ek * x
        delta = (np.log(np.maximum(z2, 1e-300)).mean(0) - np.log(z).mean()) / sharpness
        a, b = table[h][:, None, None], table[None, :, :]
        ok = a != b
        ok &= held[:, table[h]].T[:, :, None] == 0  # expert of (h, i) not on k yet
        ok &= (held[h][table] == 0)[None]  # expert of (k, j) not on h yet
        ok[:, h, :] = False
        if previous is not None and move_cost:
            ph, pk = previous[h][:, None, None], previous[None, :, :]
            delta = delta + move_cost * (
                _differs(b, ph) + _differs(a, pk) - _differs(a, ph) - _differs(b, pk)
            )
        delta = np.where(ok, delta, np.inf)
        i, k, j = np.unravel_index(int(np.argmin(delta)), delta.shape)
        if not delta[i, k, j] < -_EPS:
            break
        ea, eb = int(table[h, i]), int(table[k, j])
        table[h, i], table[k, j] = eb, ea
        slot_w[:, h, i], slot_w[:, k, j] = w[:, eb], w[:, ea]
        loads[:, h], loads[:, k] = slot_w[:, h].sum(1), slot_w[:, k].sum(1)
        held[h, ea] -= 1
        held[k, ea] += 1
        held[k, eb] -= 1
        held[h, eb] += 1
        held[:, n] = 0
    return table


def _differs(expert: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """1.0 where a slot holding `expert` would be a moved slot against `previous`."""
    return ((expert != previous) & (expert != EMPTY)).astype(np.float64)
