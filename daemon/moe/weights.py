"""Moving expert weights to a new placement: every rank keeps what it already holds and
receives the rest from the lowest rank that held it, in one all-to-all per layer."""

from __future__ import annotations

import numpy as np
import torch

from daemon.moe.ep import EPLayer, ExpertSlots
from daemon.moe.placement import EMPTY, Placement, moved_slots


def _transfers(old: np.ndarray, new: np.ndarray) -> list[tuple[int, int, int]]:
    """(source rank, destination rank, destination slot) of every expert a rank lacks,
    ordered by destination then slot (both sides derive the same order)."""
    holders: dict[int, int] = {}
    for r in range(old.shape[0] - 1, -1, -1):
        for e in old[r]:
            if e != EMPTY:
                holders[int(e)] = r
    out = []
    for r in range(new.shape[0]):
        have = set(old[r].tolist())
        for s, e in enumerate(new[r].tolist()):
            if e != EMPTY and e not in have:
                out.append((holders[e], r, s))
    return out


def move_expert_weights(layer: EPLayer, new: Placement) -> int:
    """Give this rank's slots the experts of `new` (a collective: every rank calls it with the
    same placement). Returns the number of slots, over all ranks, that changed expert."""
    ep, slots = layer.ep, layer.slots
    old_table, new_table = layer.placement.table(), new.table()
    me, size = ep.rank, ep.size
    gate_up, down = slots.gate_up, slots.down
    row = gate_up[0].numel() + down[0].numel()
    local_slot = {e: s for s, e in enumerate(slots.slot_expert) if e != EMPTY}
    transfers = _transfers(old_table, new_table)
    outgoing = [[t for t in transfers if t[0] == me and t[1] == dst] for dst in range(size)]
    incoming = [[t for t in transfers if t[0] == src and t[1] == me] for src in range(size)]
    rows = [
        torch.cat(
            [
                gate_up[local_slot[int(new_table[dst, s])]].reshape(-1),
                down[local_slot[int(new_table[dst, s])]].reshape(-1),
            ]
        )
        for group in outgoing
        for _, dst, s in group
    ]
    send = torch.stack(rows) if rows else gate_up.new_empty(0, row)
    got = gate_up.new_empty(sum(len(g) for g in incoming), row)
    ep.all_to_all(
        got.view(-1),
        send.reshape(-1),
        [len(g) * row for g in incoming],
        [len(g) * row for g in outgoing],
    )
    new_gate_up, new_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    received = {s: i for i, (_, _, s) in enumerate(t for group in incoming for t in group)}
    split = gate_up[0].numel()
    for s, e in enumerate(new_table[me].tolist()):
        if e == EMPTY:
            continue
        if e in local_slot:
            new_gate_up[s], new_down[s] = gate_up[local_slot[e]], down[local_slot[e]]
        else:
            r = got[received[s]]
            new_gate_up[s] = r[:split].view_as(gate_up[0])
            new_down[s] = r[split:].view_as(down[0])
    layer.slots = ExpertSlots(new_gate_up, new_down, new_table[me].tolist())
    moved = moved_slots(layer.placement, new)
    layer.placement = new
    return moved
