"""V4 attention over a batch of requests: shared-KV MQA on a sliding window plus, in CSA
and HCA layers, compressed entries (CSA: the lightning indexer's top-k of them), with
learned sinks and the grouped low-rank output projection.

Batched decodes attend their window (gathered from the rings) and their compressed entries
in one go; the other sequences of a step (prefill chunks, replays) too, each padded to the
longest, in groups of at most QUERY_CHUNK queries. A CSA layer whose requests see no more
entries than the indexer's k attends all of them: the indexer would pick them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from daemon.models.deepseek_v4.batch import ChunkQueries, EntryTable, V4Batch, V4Decodes
from daemon.models.deepseek_v4.blocks import (
    FP32RMSNorm,
    GroupedLinear,
    InterleavedRope,
    rms_scale,
)
from daemon.models.deepseek_v4.cache import V4Cache
from daemon.models.deepseek_v4.compressor import Compressor
from daemon.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from daemon.models.deepseek_v4.sparse import (
    NEG_INF,
    SharedInputLinears,
    WindowTiles,
    gather_rows,
    part_logits,
    part_values,
    sink_softmax_,
    topk_indices,
)

# queries attended at once: whole chunks of a step together (fewer, larger ops: on an
# accelerator each op is a launch); the indexer's keys and [queries, heads, entries] scores
# grow with the context, so it scores fewer at once: at most INDEX_CHUNK queries, and keys and
# per-head scores of at most INDEX_FLOATS float32 (64 MiB; at a 1M-token context with
# V4-Flash's 64 heads of 128, a single query still needs 192 MiB: one at a time)
QUERY_CHUNK = 2048
INDEX_CHUNK = 256
INDEX_FLOATS = 1 << 24


class Indexer(nn.Module):
    """Lightning indexer: its own overlapping compressor of keys, and per-query scores
    sum_h w_h * ReLU(q_h . k) that pick the top-k compressed entries."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.compressor = Compressor(
            cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, True, cfg.rms_norm_eps
        )
        self.q_b_proj = nn.Linear(
            cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False
        )
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        table: EntryTable,
        storage: torch.Tensor,
        counts: torch.Tensor,
        seen_by_all: int,
    ) -> torch.Tensor:
        """Top-k entries by score sum_h w_h * ReLU(q_h . k) among those a query sees.

        q [b, n, heads, dim], weights [b, n, heads], keys: the b requests' `table` (width
        E > k) in `storage` [paged blocks, per_block, dim], counts [b, n] (a query sees
        entries < its count; every query sees at least `seen_by_all`) -> indices [b, n, k],
        torch.topk's choice up to ties; a query that sees fewer than k entries is padded with
        entries it does not see. Keys are gathered per pass, for that pass's requests only."""
        b, n, e = counts.shape[0], counts.shape[1], table.width
        # ReLU commutes with positive factors: both scalings go on the weights
        scale = (self.dim**-0.5) * (self.heads**-0.5)
        unseen = torch.arange(seen_by_all, e, device=storage.device)
        # a pass: `per` requests' keys [per, E, dim] and `part` queries of each, their per-head
        # scores [per * part, heads, E]
        part = max(1, min(n, INDEX_CHUNK, INDEX_FLOATS // (self.heads * e)))
        per = max(1, min(INDEX_CHUNK // part, INDEX_FLOATS // (e * (self.dim + part * self.heads))))
        picks = []
        for i in range(0, b, per):
            j = min(b, i + per)
            keys = table.gather(storage, slice(i, j)).float().transpose(1, 2)
            row = []
            for lo in range(0, n, part):
                hi = min(n, lo + part)
                m = (j - i) * (hi - lo)
                per_head = torch.bmm(q[i:j, lo:hi].flatten(1, 2).float(), keys)
                per_head = per_head.relu_().view(m, self.heads, e)
                w = (weights[i:j, lo:hi].float() * scale).reshape(m, 1, self.heads)
                scores = torch.bmm(w, per_head).view(j - i, hi - lo, e)
                if seen_by_all < e:
                    not_seen = unseen >= counts[i:j, lo:hi, None]
                    scores[..., seen_by_all:].masked_fill_(not_seen, NEG_INF)
                row.append(topk_indices(scores, self.topk))
            picks.append(row[0] if len(row) == 1 else torch.cat(row, dim=1))
        return picks[0] if len(picks) == 1 else torch.cat(picks)


class V4Attention(nn.Module):
    def __init__(
        self, cfg: V4Config, layer: int, rope_main: InterleavedRope, rope_compress: InterleavedRope
    ) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.kind = cfg.layer_types[layer]
        self.rope = rope_main if self.kind == SLIDING else rope_compress
        self.compress_rope = rope_compress
        self.heads, self.head_dim, self.window = cfg.num_heads, cfg.head_dim, cfg.sliding_window
        self.eps = cfg.rms_norm_eps
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = FP32RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.num_heads * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.kv_norm = FP32RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(
            cfg.num_heads * cfg.head_dim // cfg.o_groups,
            cfg.o_groups * cfg.o_lora_rank,
            cfg.o_groups,
        )
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads, dtype=torch.float32))
        self.compressor = None
        self.indexer = None
        if self.kind == CSA:
            self.rate = cfg.csa_rate
            self.compressor = Compressor(
                cfg.hidden_size, cfg.head_dim, cfg.csa_rate, True, cfg.rms_norm_eps
            )
            self.indexer = Indexer(cfg)
        elif self.kind == HCA:
            self.rate = cfg.hca_rate
            self.compressor = Compressor(
                cfg.hidden_size, cfg.head_dim, cfg.hca_rate, False, cfg.rms_norm_eps
            )
        # every projection of the layer input, and of q_residual, as one matmul each
        of_x = [self.q_a_proj, self.kv_proj]
        of_q = [self.q_b_proj]
        if self.compressor is not None:
            of_x += [self.compressor.kv_proj, self.compressor.gate_proj]
        if self.indexer is not None:
            idx = self.indexer
            of_x += [idx.weights_proj, idx.compressor.kv_proj, idx.compressor.gate_proj]
            of_q.append(idx.q_b_proj)
        self.x_projections = SharedInputLinears(*of_x)
        self.q_projections = SharedInputLinears(*of_q)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: V4Batch, cache: V4Cache
    ) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = self._rope_table(self.rope, positions, batch)
        q_a, kv, *rest = self.x_projections(x)
        q_residual = self.q_a_norm(q_a)
        q, *index_q = self.q_projections(q_residual)
        q = self.rope.apply(self._queries(q.view(t, self.heads, self.head_dim)), cos, sin)
        kv = self.rope.apply(self.kv_norm(kv), cos, sin)
        projected = None
        if self.compressor is not None:
            projected = (rest[0], rest[1])
        index_inputs = None
        if self.indexer is not None:
            ccos, csin = self._rope_table(self.compress_rope, positions, batch)
            iq = index_q[0].view(t, self.indexer.heads, self.indexer.dim)
            index_inputs = (self.compress_rope.apply(iq, ccos, csin), *rest[2:])
        if self.compressor is not None and self.kind in batch.compression:
            windows = batch.compression[self.kind]
            self.compressor.update_chunks(
                rest[0], rest[1], cache.layers[self.layer], windows, self.compress_rope
            )
            if self.indexer is not None:
                self.indexer.compressor.update_chunks(
                    rest[3], rest[4], cache.indexers[self.layer], windows, self.compress_rope
                )
        out = torch.empty_like(q)
        if batch.decodes is not None:
            d = batch.decodes
            out[d.rows] = self._attend_decodes(d, q, kv, projected, index_inputs, cache)
        if batch.queries is not None:
            self._attend_chunks(batch.queries, q, kv, index_inputs, cache, out)
        out = self.rope.apply(out, cos, sin, inverse=True)
        grouped = self.o_a_proj(out.reshape(t, self.cfg.o_groups, -1)).flatten(1)
        return self.o_b_proj(grouped)

    @staticmethod
    def _rope_table(
        rope: InterleavedRope, positions: torch.Tensor, batch: V4Batch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the step's positions, computed once per step and rope."""
        table = batch.rope_tables.get(id(rope))
        if table is None:
            table = batch.rope_tables[id(rope)] = rope.cos_sin(positions)
        return table

    def _queries(self, q: torch.Tensor) -> torch.Tensor:
        """Per-head RMS norm (no weight) of q [t, H, D], with the softmax scale D^-0.5 folded
        into its factor: one pass over q, and a contiguous result."""
        factor = rms_scale(q, self.eps).mul_(self.head_dim**-0.5)
        return q * factor.unsqueeze(-1).to(q.dtype)

    def _attend_chunks(
        self, c: ChunkQueries, q, kv, index_inputs, cache: V4Cache, out: torch.Tensor
    ) -> None:
        """Every chunk of the step (prefill, chunked prefill, replay) at once, into out: the
        window in tiles, then the compressed entries (all of them, or the indexer's top-k),
        in groups of at most QUERY_CHUNK queries (whole chunks, or tiles of one chunk)."""
        ring = cache.swa[self.layer].view(-1, self.head_dim)
        before = gather_rows(ring, c.ring_rows).to(kv.dtype)  # [R, W - 1, D]
        keys = torch.cat((before, gather_rows(kv, c.query_rows)), dim=1)
        tiles = WindowTiles(keys, c.missing, self.window, self.heads)
        ring.index_copy_(0, c.ring_dst, kv.index_select(0, c.ring_src).to(ring.dtype))
        entries = None
        table = c.entry_tables.get(self.kind) if self.compressor is not None else None
        if table is not None:
            entries = self._entries(
                table, lambda t: gather_rows(t, c.query_rows), index_inputs, cache
            )
        qs = gather_rows(q, c.query_rows)  # [R, padded, H, D]
        o = qs.new_empty(qs.shape)
        per_chunk = c.padded // tiles.tile
        chunks_at_once = max(1, QUERY_CHUNK // c.padded)
        tiles_at_once = max(1, QUERY_CHUNK // tiles.tile)
        for r0 in range(0, c.count, chunks_at_once):
            chunks = slice(r0, min(c.count, r0 + chunks_at_once))
            for t0 in range(0, per_chunk, tiles_at_once):
                group = slice(t0, min(per_chunk, t0 + tiles_at_once))
                lo, hi = group.start * tiles.tile, group.stop * tiles.tile
                window = tiles.logits(qs[chunks, lo:hi], chunks, group)
                parts = [window]
                if entries is not None:
                    queries = slice(lo, hi)
                    seen = (c.positions[chunks, queries] + 1) // self.rate
                    logits, values = entries.attend(qs[chunks, queries], seen, chunks, queries)
                    parts.append(logits)
                norm = sink_softmax_(parts, self.sinks.float())
                part = tiles.values(window, chunks, group)
                if entries is not None:
                    part += values(logits)
                o[chunks, lo:hi] = (part * norm).view(o[chunks, lo:hi].shape)
        out.index_copy_(0, c.out_rows, o.flatten(0, 1).index_select(0, c.out_src))

    def _entries(
        self,
        table: EntryTable,
        queries: Callable[[torch.Tensor], torch.Tensor],
        index_inputs,
        cache: V4Cache,
    ) -> CompressedEntries:
        """The compressed entries of R requests in `table`; `queries` takes a tensor of the
        step's tokens [T, ...] to those requests' queries [R, n, ...]."""
        storage = cache.layers[self.layer].entries
        if self.indexer is None or table.width <= self.indexer.topk:
            return CompressedEntries(self.heads, table.gather(storage))
        return CompressedEntries(
            self.heads,
            dense=None,
            storage=storage.view(-1, self.head_dim),
            table=table,
            index_storage=cache.indexers[self.layer].entries,
            index_q=queries(index_inputs[0]),
            index_weights=queries(index_inputs[1]),
            indexer=self.indexer,
        )

    def _attend_decodes(
        self, d: V4Decodes, q, kv, projected, index_inputs, cache: V4Cache
    ) -> torch.Tensor:
        """Every one-token step of the batch at once: windows from the rings, then the
        compressed entries (each request's padded to the longest, or the indexer's top-k)."""
        ring = cache.swa[self.layer].view(-1, self.head_dim)
        ring.index_copy_(0, d.new_rows, kv[d.rows].to(ring.dtype))
        window = gather_rows(ring, d.window_rows).to(kv.dtype)  # [B, W, D], the new token last
        q = q[d.rows]
        blocked = None if d.window_padding is None else d.window_padding[:, None, :]
        compressed = None
        if self.compressor is not None:
            e = d.entries[self.kind]
            self.compressor.update_decode(
                projected[0][d.rows],
                projected[1][d.rows],
                cache.layers[self.layer],
                d.state_blocks,
                e,
                self.compress_rope,
            )
            if self.indexer is not None:
                self.indexer.compressor.update_decode(
                    index_inputs[2][d.rows],
                    index_inputs[3][d.rows],
                    cache.indexers[self.layer],
                    d.state_blocks,
                    e,
                    self.compress_rope,
                )
            if e.table.width:
                entries = self._entries(e.table, lambda t: t[d.rows][:, None], index_inputs, cache)
                compressed = entries.attend(q[:, None], e.counts[:, None], slice(None), slice(None))
        window_logits = part_logits(q, window, blocked)
        logits = [window_logits] if compressed is None else [window_logits, compressed[0]]
        norm = sink_softmax_(logits, self.sinks.float())
        out = part_values(window_logits, window)
        if compressed is not None:
            out += compressed[1](compressed[0])
        return out * norm


@dataclass
class CompressedEntries:
    """The compressed entries R requests attend (their chunks' queries, or their decodes):
    all of them (`dense`, [R, E, D]) or, for CSA with more than k, the indexer's top-k per
    query, gathered from `storage` by `rows`."""

    heads: int
    dense: torch.Tensor | None
    storage: torch.Tensor | None = None  # the layer's entries.view(-1, D)
    table: EntryTable | None = None  # each request's entries
    index_storage: torch.Tensor | None = None  # the indexer's entries [blocks, per_block, dim]
    index_q: torch.Tensor | None = None  # [R, n, index heads, index dim]
    index_weights: torch.Tensor | None = None  # [R, n, index heads]
    indexer: Indexer | None = None

    def attend(
        self, q: torch.Tensor, seen: torch.Tensor, requests: slice, queries: slice
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """Logits [r * n, H, L] of queries `queries` of requests `requests` (q [r, n, H, D],
        each seeing the entries below its `seen` [r, n]), and how to turn their probabilities
        into unnormalised outputs [r * n, H, D]."""
        r, n = seen.shape
        if self.dense is not None:
            keys = self.dense[requests].to(q.dtype)  # [r, E, D]
            e = keys.shape[1]
            logits = torch.matmul(q.reshape(r, n * self.heads, -1), keys.transpose(1, 2))
            logits = logits.float().view(r, n, self.heads, e)
            blocked = torch.arange(e, device=q.device) >= seen[..., None]
            logits.masked_fill_(blocked[:, :, None, :], NEG_INF)

            def values(probs: torch.Tensor) -> torch.Tensor:
                flat = probs.to(keys.dtype).view(r, n * self.heads, e)
                return torch.matmul(flat, keys).view(r * n, self.heads, -1)

            return logits.view(r * n, self.heads, e), values
        table = self.table.of(requests)
        picks = self.indexer.select(
            self.index_q[requests, queries],
            self.index_weights[requests, queries],
            table,
            self.index_storage,
            seen,
            0,
        )  # [r, n, k]
        k = picks.shape[-1]
        rows = table.rows(picks).view(r * n, k)
        keys = gather_rows(self.storage, rows).to(q.dtype)  # [r * n, k, D]
        blocked = (picks >= seen[..., None]).view(r * n, 1, k)
        logits = part_logits(q.reshape(r * n, self.heads, -1), keys, blocked)
        return logits, lambda probs: part_values(probs, keys)
