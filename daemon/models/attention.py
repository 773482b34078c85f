"""Paged attention over a flat token batch (decodes first, then prefill chunks), in torch, and
`PagedKVCache`, the dense models' cache.

Layout of one step:   [ d0 d1 ... dB | p0 p0 p0 p0 | p1 p1 ... ]
                        decode tokens   prefill chunks (variable length)
Decodes are attended in one call: on CPU by a kernel that reads the KV blocks in place
(kernels/paged_attention_cpu.py), elsewhere by gathering them into a padded batch for SDPA;
each prefill chunk in its own SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from daemon.kv.spec import FullAttentionSpec
from daemon.models import huge_pages
from daemon.models.base import KVExport, RequestState, SeqSlice
from daemon.models.kv_transfer import export_blocks, import_blocks
from kernels import paged_attention_cpu, prefill_attention_cpu


@dataclass
class PrefillChunk:
    q_start: int
    q_len: int
    kv_index: torch.Tensor | None  # flat cache slots of positions [0, ctx); None = fresh prompt
    mask: torch.Tensor | None  # [q_len, ctx] bool, True = attend; None = plain causal


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [T] flat cache slot written by each token
    num_decodes: int
    decode_tables: torch.Tensor  # [B, max_blocks] block ids (padded with block 0)
    decode_mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]
    block_size: int = 16
    # [B] context length of each decode; None: counted from decode_mask (a prefix per row)
    decode_lens: torch.Tensor | None = None

    def to(self, device: torch.device) -> AttentionBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return AttentionBatch(
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            num_decodes=self.num_decodes,
            decode_tables=self.decode_tables.to(device, non_blocking=True),
            decode_mask=self.decode_mask.to(device, non_blocking=True),
            prefills=[
                PrefillChunk(p.q_start, p.q_len, move(p.kv_index), move(p.mask))
                for p in self.prefills
            ],
            block_size=self.block_size,
            decode_lens=move(self.decode_lens),
        )

    def context_lens(self) -> torch.Tensor:
        """[B] context length of each decode."""
        if self.decode_lens is not None:
            return self.decode_lens
        return self.decode_mask.view(self.num_decodes, -1).sum(-1)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A layer's K or V: in huge pages on a CPU (decode attention reads its blocks from
    anywhere in the pool)."""
    if device.type == "cpu":
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class PagedKVCache:
    """K and V of every layer in flat slots: slot = block * block_size + offset. One block past
    the pool's is scratch: padded rows of a CUDA-graph batch write their KV there.

    A request's whole state is in its blocks (one group): there is no per-request state, so a
    snapshot is empty and a rollback only moves the request's position back (a step attends
    to the positions before its own, and writes its own before reading them)."""

    def __init__(self, spec: FullAttentionSpec, num_blocks: int, device: torch.device) -> None:
        self.block_size = spec.block_size
        self.num_slots = num_blocks * spec.block_size
        shape = (self.num_slots + spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [
            (_zeros(shape, spec.dtype, device), _zeros(shape, spec.dtype, device))
            for _ in range(spec.num_layers)
        ]
        probe = torch.empty(0, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype, device=device)
        if paged_attention_cpu.supports(probe, probe):
            paged_attention_cpu.build()  # before any forward, compiled or eager, runs the op

    @property
    def scratch_slot(self) -> int:
        """The first slot past the pool's blocks."""
        return self.num_slots

    def block_views(self, group: int) -> list[torch.Tensor]:
        """Every tensor of the (single) group, indexed by block on dim 0 (the pool's blocks)."""
        return [
            t[: self.num_slots].view(-1, self.block_size, *t.shape[1:])
            for kv in self.layers
            for t in kv
        ]

    def snapshot(self, tables: list[list[int]], position: int) -> RequestState:
        return RequestState(position)  # nothing beyond the blocks

    def restore_state(self, state: RequestState, tables: list[list[int]]) -> None:
        """Nothing to put back: the blocks are the whole state (see the class)."""

    def export_kv(self, tables: list[list[int]], start: int, end: int) -> KVExport:
        blocks = export_blocks(self, [0], tables, start, end, self.block_size)
        return KVExport(start, end, blocks, RequestState(end))

    def import_kv(self, export: KVExport, tables: list[list[int]]) -> None:
        import_blocks(self, export.blocks, tables, export.start, export.end, self.block_size)

    def build_attention(self, seqs: list[SeqSlice]) -> AttentionBatch:
        bs = self.block_size
        slot_mapping: list[int] = []
        decode_ctx: list[tuple[list[int], int]] = []
        prefill_ctx: list[tuple[int, int, list[int], int]] = []
        for s in seqs:
            table = s.block_tables[0]
            end = s.start + s.num_tokens
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(s.start, end))
            if s.is_decode:
                decode_ctx.append((table, end))
            else:
                prefill_ctx.append((s.q_start, s.num_tokens, table, end))
        return build_attention_batch(decode_ctx, prefill_ctx, slot_mapping, bs)


def build_attention_batch(
    decode_ctx: list[tuple[list[int], int]],
    prefill_ctx: list[tuple[int, int, list[int], int]],
    slot_mapping: list[int],
    block_size: int,
) -> AttentionBatch:
    """decode_ctx: (block_table, ctx_len) per decode.
    prefill_ctx: (q_start, q_len, block_table, ctx_len) per prefill chunk."""

    def slots(table: list[int], n: int) -> torch.Tensor:
        pos = torch.arange(n)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        return blocks * block_size + pos % block_size

    # Decodes gather whole blocks (an index per block, not per token: cheap to build).
    num_decodes = len(decode_ctx)
    lmax = max((n for _, n in decode_ctx), default=0)
    lens = torch.tensor([n for _, n in decode_ctx], dtype=torch.long)
    max_blocks = -(-lmax // block_size)
    padded = [table[: -(-n // block_size)] for table, n in decode_ctx]
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in padded], dtype=torch.long)
    tables = tables.view(num_decodes, max_blocks)
    width = max_blocks * block_size
    decode_mask = (torch.arange(width)[None, :] < lens[:, None]).view(num_decodes, 1, 1, width)

    prefills = []
    for q_start, q_len, table, ctx in prefill_ctx:
        if ctx == q_len:
            prefills.append(PrefillChunk(q_start, q_len, None, None))
            continue
        q_pos = torch.arange(ctx - q_len, ctx)
        mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
        prefills.append(PrefillChunk(q_start, q_len, slots(table, ctx), mask))
    return AttentionBatch(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        num_decodes=num_decodes,
        decode_tables=tables,
        decode_mask=decode_mask,
        prefills=prefills,
        block_size=block_size,
        decode_lens=lens,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [slots, Hkv, D]. Writes k, v, returns [T, Hq, D]."""
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    b = batch.num_decodes
    decoded = None
    if b and paged_attention_cpu.supports(q, k_cache):
        decoded = paged_attention_cpu.paged_decode_attention(
            q[:b],
            k_cache,
            v_cache,
            batch.decode_tables,
            batch.context_lens(),
            scale,
            batch.block_size,
        )
    elif b:
        decoded = paged_attention_cpu.paged_decode_reference(
            q[:b],
            k_cache,
            v_cache,
            batch.decode_tables,
            batch.decode_mask,
            scale,
            batch.block_size,
        )
    if decoded is not None and b == q.shape[0]:
        return decoded  # a decode-only step
    out = torch.empty_like(q)
    if decoded is not None:
        out[:b] = decoded
    # one answer for every chunk: a cached context's gathered rows share k's dtype and layout
    fast = bool(batch.prefills) and prefill_attention_cpu.supports(q, k, v, out)
    for p in batch.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        if p.kv_index is None:
            ks, vs = k[rows], v[rows]
        else:
            ks = k_cache.index_select(0, p.kv_index)
            vs = v_cache.index_select(0, p.kv_index)
        if fast:
            prefill_attention_cpu.prefill_attention(q[rows], ks, vs, scale, out[rows])
            continue
        o = chunk_attention(
            q[rows].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), p.mask, scale
        )
        out[rows] = o.transpose(0, 1)
    return out


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    fused: bool = True,
) -> torch.Tensor:
    """One prefill chunk: q [Hq, n, D] over k, v [Hkv, ctx, D], causal with the chunk at the
    end of its context (`mask` [n, ctx], None where n == ctx). `fused` (the default) gives
    SDPA what its flash / memory-efficient kernels take: KV heads repeated for GQA, the causal
    mask as a lower-right bias (not a boolean tensor), 4-d tensors; the plain call (3-d, GQA
    and a boolean mask) runs the math kernel, which materialises every score. On an H200 an
    8K-token prefill of a Llama-8B shape took 2.0 s plain, 0.28 s fused; on 2 CPU cores a
    2048-token chunk of SmolLM2's attention 251 ms plain, 40 ms fused (bf16). CPU's flash
    kernel takes GQA itself (`enable_gqa`): SmolLM2's 256-token chunk 10-18 % faster than with
    the heads repeated, and the same bits; elsewhere the heads are repeated (CUDA's
    memory-efficient kernel, which a bias selects, does not take `enable_gqa`)."""
    gqa = q.shape[0] != k.shape[0]
    if not fused:
        causal = dict(is_causal=True) if mask is None else dict(attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **causal)
    if gqa and q.device.type != "cpu":
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        gqa = False
    q, k, v = q[None], k[None], v[None]  # the fused kernels take 4-d tensors only
    causal = (
        dict(is_causal=True)
        if mask is None
        else dict(attn_mask=causal_lower_right(q.shape[2], k.shape[2]))
    )
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **causal)[0]
