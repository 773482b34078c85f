"""The V4 compressors: one gated-pooled entry per closed window of m tokens.

HCA (non-overlapping):  entry w = norm(sum_j softmax_j(gate + bias) * kv) over window w.
CSA (overlapping):      projections give two series per token, Ca | Cb; entry w pools
                        Ca of window w-1 with Cb of window w (8 slots for m = 4), so the
                        Ca half of the last closed window is carried between steps.
Entries get RoPE at their window's first absolute position.
"""

from __future__ import annotations

import torch
from torch import nn

from daemon.models.deepseek_v4.blocks import FP32RMSNorm, InterleavedRope
from daemon.models.deepseek_v4.cache import CompressorState


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width, dtype=torch.float32))
        self.kv_norm = FP32RMSNorm(dim, eps)

    def update(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        start: int,
        st: CompressorState,
        state_block: int,
        table: list[int],
        rope: InterleavedRope,
    ) -> None:
        """Feed one request's projected tokens at positions [start, start+n); write the
        entries of every window they close into the paged storage."""
        m, dim = self.rate, self.dim
        buffered = start % m
        kv = torch.cat((st.buf_kv[state_block, :buffered], kv.float()))
        gate = torch.cat((st.buf_gate[state_block, :buffered], gate.float()))
        usable = kv.shape[0] // m * m
        left = kv.shape[0] - usable
        st.buf_kv[state_block, :left] = kv[usable:]
        st.buf_gate[state_block, :left] = gate[usable:]
        windows = usable // m
        if windows == 0:
            return
        chunk_kv = kv[:usable].view(windows, m, -1)
        chunk_gate = gate[:usable].view(windows, m, -1) + self.position_bias.float()
        if self.overlap:
            pooled_kv = chunk_kv.new_zeros(windows, 2 * m, dim)
            pooled_gate = chunk_gate.new_full((windows, 2 * m, dim), float("-inf"))
            pooled_kv[:, m:] = chunk_kv[..., dim:]
            pooled_gate[:, m:] = chunk_gate[..., dim:]
            pooled_kv[1:, :m] = chunk_kv[:-1, :, :dim]
            pooled_gate[1:, :m] = chunk_gate[:-1, :, :dim]
            pooled_kv[0, :m] = st.ovl_kv[state_block]
            pooled_gate[0, :m] = st.ovl_gate[state_block]
            st.ovl_kv[state_block] = chunk_kv[-1, :, :dim]
            st.ovl_gate[state_block] = chunk_gate[-1, :, :dim]
        else:
            pooled_kv, pooled_gate = chunk_kv, chunk_gate
        entries = self.kv_norm((pooled_kv * pooled_gate.softmax(dim=1)).sum(dim=1))
        first = (start - buffered) // m
        positions = torch.arange(first, first + windows, device=kv.device) * m
        entries = rope.apply(entries, *rope.cos_sin(positions))
        self._store(entries, first, st, table, chunk_kv, chunk_gate)

    def update_decode(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        positions: list[int],
        st: CompressorState,
        state_blocks: list[int],
        tables: list[list[int]],
        rope: InterleavedRope,
    ) -> None:
        """One token for each of B requests (kv, gate: [B, C]); closes the windows that end."""
        m, dim, dev = self.rate, self.dim, kv.device
        blocks = torch.tensor(state_blocks, device=dev)
        slots = torch.tensor([p % m for p in positions], device=dev)
        st.buf_kv[blocks, slots] = kv.float()
        st.buf_gate[blocks, slots] = gate.float()
        closing = [i for i, p in enumerate(positions) if (p + 1) % m == 0]
        if not closing:
            return
        sb = blocks[closing]
        chunk_kv = st.buf_kv[sb]
        chunk_gate = st.buf_gate[sb] + self.position_bias.float()
        if self.overlap:
            pooled_kv = torch.cat((st.ovl_kv[sb], chunk_kv[..., dim:]), dim=1)
            pooled_gate = torch.cat((st.ovl_gate[sb], chunk_gate[..., dim:]), dim=1)
            st.ovl_kv[sb] = chunk_kv[..., :dim]
            st.ovl_gate[sb] = chunk_gate[..., :dim]
        else:
            pooled_kv, pooled_gate = chunk_kv, chunk_gate
        entries = self.kv_norm((pooled_kv * pooled_gate.softmax(dim=1)).sum(dim=1))
        windows = [(positions[i] + 1) // m - 1 for i in closing]
        entries = rope.apply(entries, *rope.cos_sin(torch.tensor(windows, device=dev) * m))
        per_block = st.entries.shape[1]
        paged = torch.tensor(
            [tables[i][w // per_block] for i, w in zip(closing, windows)], device=dev
        )
        offsets = torch.tensor([w % per_block for w in windows], device=dev)
        st.entries[paged, offsets] = entries.to(st.entries.dtype)
        if self.overlap:
            ends = [j for j, w in enumerate(windows) if (w + 1) % per_block == 0]
            if ends:
                st.block_ovl_kv[paged[ends]] = chunk_kv[ends, :, :dim]
                st.block_ovl_gate[paged[ends]] = chunk_gate[ends, :, :dim]

    @staticmethod
    def gather_padded(
        st: CompressorState, tables: list[list[int]], counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries of B requests padded to the longest: [B, E, dim] and the valid mask [B, E]."""
        per_block = st.entries.shape[1]
        dev = st.entries.device
        longest = max(counts)
        nblocks = -(-longest // per_block)
        index = torch.zeros(len(tables), nblocks, dtype=torch.long)
        for i, (table, count) in enumerate(zip(tables, counts)):
            used = -(-count // per_block)
            index[i, :used] = torch.tensor(table[:used], dtype=torch.long)
        entries = st.entries[index.to(dev)].flatten(1, 2)[:, :longest]
        valid = (
            torch.arange(longest, device=dev)[None, :] < torch.tensor(counts, device=dev)[:, None]
        )
        return entries, valid

    def _store(
        self,
        entries: torch.Tensor,
        first: int,
        st: CompressorState,
        table: list[int],
        chunk_kv: torch.Tensor,
        chunk_gate: torch.Tensor,
    ) -> None:
        per_block = st.entries.shape[1]
        index = torch.arange(first, first + entries.shape[0], device=entries.device)
        blocks = torch.tensor(table, dtype=torch.long, device=entries.device)[index // per_block]
        st.entries[blocks, index % per_block] = entries.to(st.entries.dtype)
        if self.overlap:
            # a window that ends a block: its Ca half is the overlap a resume there needs
            ends = ((index + 1) % per_block == 0).nonzero().flatten()
            if ends.numel():
                st.block_ovl_kv[blocks[ends]] = chunk_kv[ends, :, : self.dim]
                st.block_ovl_gate[blocks[ends]] = chunk_gate[ends, :, : self.dim]

    @staticmethod
    def gather(st: CompressorState, table: list[int], count: int) -> torch.Tensor:
        """The first `count` entries of a request, in order: [count, dim]."""
        per_block = st.entries.shape[1]
        blocks = torch.tensor(
            table[: -(-count // per_block)], dtype=torch.long, device=st.entries.device
        )
        return st.entries[blocks].flatten(0, 1)[:count]
