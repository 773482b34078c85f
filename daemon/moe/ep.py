"""Expert parallelism for one MoE layer. Routing stays local (every rank has the router and
the shared expert); each (token, expert) pair goes to the rank holding the replica chosen
for it, the expert slots of each rank run there, and the results come back (all-to-all)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from daemon.moe.placement import EMPTY, Placement

ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # x, w1, w2


@dataclass
class EPGroup:
    """This process's place in the expert-parallel group (one daemon process per rank)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # token exchange (NCCL/HCCL on accelerators)
    control: dist.ProcessGroup | None = None  # small CPU collectives (gloo): flags, statistics

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)


class ExpertSlots:
    """The expert weights one rank holds for one layer: slot s serves expert slot_expert[s]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, slot_expert: list[int]) -> None:
        self.gate_up, self.down, self.slot_expert = (
            gate_up,
            down,
            slot_expert,
        )  # [S, 2I, H], [S, H, I]

    @classmethod
    def take(
        cls, gate_up: torch.Tensor, down: torch.Tensor, placement: Placement, rank: int
    ) -> ExpertSlots:
        """This rank's slots, copied out of the full [E, ...] expert weights."""
        s = placement.slots_per_rank
        experts = placement.phys_to_logical[rank * s : (rank + 1) * s]
        idx = torch.tensor([max(e, 0) for e in experts], dtype=torch.long, device=gate_up.device)
        return cls(gate_up[idx].clone(), down[idx].clone(), experts)


class EPLayer:
    """One MoE layer's routed experts spread over the group."""

    def __init__(
        self, ep: EPGroup, placement: Placement, slots: ExpertSlots, expert: ExpertFn
    ) -> None:
        self.ep, self.placement, self.slots, self.expert = ep, placement, slots, expert

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [N, H], experts / weights [N, k] -> routed expert output [N, H]. Every rank calls
        this once per layer per step, with N = 0 when it has no tokens."""
        n, k = experts.shape
        size, per_rank = self.ep.size, self.placement.slots_per_rank
        token = torch.arange(n, device=x.device).unsqueeze(1).expand(n, k)
        phys = self.placement.choose_replicas(experts, token).reshape(-1)
        dest = phys // per_rank
        order = torch.argsort(dest, stable=True)
        pair_token = order // k
        pair_slot = (phys % per_rank)[order]
        pair_weight = weights.reshape(-1)[order]
        send = torch.bincount(dest, minlength=size).to(torch.long)
        recv = torch.empty_like(send)
        self.ep.all_to_all(recv, send, [1] * size, [1] * size)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        got_x = x.new_empty(sum(recv_splits), x.shape[1])
        self.ep.all_to_all(got_x, x[pair_token].contiguous(), recv_splits, send_splits)
        got_slot = torch.empty(sum(recv_splits), dtype=torch.long, device=x.device)
        self.ep.all_to_all(got_slot, pair_slot.contiguous(), recv_splits, send_splits)
        y = self._run_slots(got_x, got_slot)
        back = x.new_empty(n * k, x.shape[1])
        self.ep.all_to_all(back, y, send_splits, recv_splits)
        out = torch.zeros_like(x)
        out.index_add_(0, pair_token, (back * pair_weight[:, None]).to(x.dtype))
        return out

    def _run_slots(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        if not len(slot):
            return y
        order = torch.argsort(slot, stable=True)
        counts = torch.bincount(slot, minlength=len(self.slots.slot_expert)).tolist()
        begin = 0
        for s, count in enumerate(counts):
            if count == 0:
                continue
            assert self.slots.slot_expert[s] != EMPTY, "a token was sent to an empty slot"
            rows = order[begin : begin + count]
            y[rows] = self.expert(x[rows], self.slots.gate_up[s], self.slots.down[s]).to(y.dtype)
            begin += count
        return y
