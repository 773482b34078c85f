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

from daemon.models.deepseek_v4.batch import ChunkWindows, DecodeEntries
from daemon.models.deepseek_v4.blocks import FP32RMSNorm, InterleavedRope
from daemon.models.deepseek_v4.kv import CompressorState
from daemon.models.deepseek_v4.sparse import gather_rows


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width, dtype=torch.float32))
        self.kv_norm = FP32RMSNorm(dim, eps)

    def update_chunks(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        st: CompressorState,
        c: ChunkWindows,
        rope: InterleavedRope,
    ) -> None:
        """Feed every prefill chunk's projected tokens (kv, gate: the step's [T, C]) at once:
        write the entries of every window they close, keep the rest in the open windows."""
        width, dim = st.buf_kv.shape[-1], self.dim
        buf_kv, buf_gate = st.buf_kv.view(-1, width), st.buf_gate.view(-1, width)
        src_kv = torch.cat(
            (buf_kv.index_select(0, c.buffered), kv.index_select(0, c.token_rows).float())
        )
        src_gate = torch.cat(
            (buf_gate.index_select(0, c.buffered), gate.index_select(0, c.token_rows).float())
        )
        buf_kv.index_copy_(0, c.left_dst, src_kv.index_select(0, c.left_src))
        buf_gate.index_copy_(0, c.left_dst, src_gate.index_select(0, c.left_src))
        if not c.count:
            return
        chunk_kv = gather_rows(src_kv, c.windows)  # [W, m, C]
        chunk_gate = gather_rows(src_gate, c.windows) + self.position_bias.float()
        if self.overlap:
            # window w pools the Ca of the window before it (the stored overlap for a chunk's
            # first) with its own Cb
            prev_kv = torch.cat((st.ovl_kv.index_select(0, c.first_state), chunk_kv[..., :dim]))
            prev_gate = torch.cat(
                (st.ovl_gate.index_select(0, c.first_state), chunk_gate[..., :dim])
            )
            pooled_kv = torch.cat((prev_kv.index_select(0, c.previous), chunk_kv[..., dim:]), dim=1)
            pooled_gate = torch.cat(
                (prev_gate.index_select(0, c.previous), chunk_gate[..., dim:]), dim=1
            )
            st.ovl_kv.index_copy_(0, c.first_state, chunk_kv[..., :dim].index_select(0, c.last))
            st.ovl_gate.index_copy_(0, c.first_state, chunk_gate[..., :dim].index_select(0, c.last))
        else:
            pooled_kv, pooled_gate = chunk_kv, chunk_gate
        self._store(pooled_kv, pooled_gate, rope.cos_sin(c.positions), c.entry_rows, st, rope)
        if self.overlap and c.block_ends.numel():
            self._keep_block_overlap(st, c.end_blocks, chunk_kv, chunk_gate, c.block_ends)

    def update_decode(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        st: CompressorState,
        state_blocks: torch.Tensor,
        d: DecodeEntries,
        rope: InterleavedRope,
    ) -> None:
        """One token for each of B requests (kv, gate: [B, C]); closes the windows that end
        (with `d.closing_mask`: pools every row's window, those that close nothing into a
        scratch row, so that no shape depends on which rows close)."""
        width = st.buf_kv.shape[-1]
        st.buf_kv.view(-1, width).index_copy_(0, d.buffer_rows, kv.float())
        st.buf_gate.view(-1, width).index_copy_(0, d.buffer_rows, gate.float())
        if not d.closing.numel():
            return
        dim, sb = self.dim, d.closing_state
        chunk_kv = st.buf_kv.index_select(0, sb)
        chunk_gate = st.buf_gate.index_select(0, sb) + self.position_bias.float()
        if self.overlap:
            old_kv, old_gate = st.ovl_kv.index_select(0, sb), st.ovl_gate.index_select(0, sb)
            pooled_kv = torch.cat((old_kv, chunk_kv[..., dim:]), dim=1)
            pooled_gate = torch.cat((old_gate, chunk_gate[..., dim:]), dim=1)
            new_kv, new_gate = chunk_kv[..., :dim], chunk_gate[..., :dim]
            if d.closing_mask is not None:  # fixed shapes: a row that closes nothing keeps its Ca
                closes = d.closing_mask[:, None, None]
                new_kv, new_gate = new_kv.where(closes, old_kv), new_gate.where(closes, old_gate)
            st.ovl_kv.index_copy_(0, sb, new_kv)
            st.ovl_gate.index_copy_(0, sb, new_gate)
        else:
            pooled_kv, pooled_gate = chunk_kv, chunk_gate
        if d.closed_rope is None:
            d.closed_rope = rope.cos_sin(d.closed_positions)
        self._store(pooled_kv, pooled_gate, d.closed_rope, d.closed_rows, st, rope)
        if self.overlap and d.block_ends.numel():
            self._keep_block_overlap(st, d.end_blocks, chunk_kv, chunk_gate, d.block_ends)

    def _store(
        self,
        pooled_kv: torch.Tensor,
        pooled_gate: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor,
        st: CompressorState,
        rope: InterleavedRope,
    ) -> None:
        """Pool each window's slots ([W, slots, dim], softmax over the gate), norm, rotate at
        the window's first position and write the entries to their `rows`."""
        entries = self.kv_norm((pooled_kv * pooled_gate.softmax(dim=1)).sum(dim=1))
        entries = rope.apply(entries, *cos_sin)
        st.entries.view(-1, self.dim).index_copy_(0, rows, entries.to(st.entries.dtype))

    def _keep_block_overlap(
        self,
        st: CompressorState,
        blocks: torch.Tensor,
        chunk_kv: torch.Tensor,
        chunk_gate: torch.Tensor,
        windows: torch.Tensor,
    ) -> None:
        """CSA: the Ca half of a window that ends a paged block is the overlap a resume at
        that block needs; kept per block."""
        st.block_ovl_kv[blocks] = chunk_kv[windows, :, : self.dim]
        st.block_ovl_gate[blocks] = chunk_gate[windows, :, : self.dim]
