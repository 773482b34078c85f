"""V4 attention over a batch of requests: shared-KV MQA on a sliding window plus, in CSA
and HCA layers, compressed entries (CSA: the lightning indexer's top-k of them), with
learned sinks and the grouped low-rank output projection.

Batched decodes attend their window (gathered from the rings) and their compressed entries
in one go; every other sequence (a prefill chunk, a replay) runs alone, in chunks of at most
QUERY_CHUNK queries so every temporary stays small. A CSA layer whose requests see no more
entries than the indexer's k attends all of them: the indexer would pick them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from daemon.models.deepseek_v4.blocks import (
    FP32RMSNorm,
    GroupedLinear,
    InterleavedRope,
    rms_scale,
)
from daemon.models.deepseek_v4.cache import (
    DecodeEntries,
    V4Batch,
    V4Cache,
    V4Decodes,
    V4SeqMeta,
)
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

QUERY_CHUNK = 256  # queries attended, and scored by the indexer, at once


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
        keys: torch.Tensor,
        counts: torch.Tensor,
        seen_by_all: int,
    ) -> torch.Tensor:
        """Top-k entries by score sum_h w_h * ReLU(q_h . k) among those a query sees.

        q [b, n, heads, dim], weights [b, n, heads], keys [b, E, dim] with E > k, counts
        [b, n] (a query sees entries < its count; every query sees at least `seen_by_all`)
        -> indices [b, n, k], torch.topk's choice up to ties; a query that sees fewer than k
        entries is padded with entries it does not see."""
        b, n, e = counts.shape[0], counts.shape[1], keys.shape[1]
        # ReLU commutes with positive factors: both scalings go on the weights
        scale = (self.dim**-0.5) * (self.heads**-0.5)
        unseen = torch.arange(seen_by_all, e, device=keys.device)
        per = max(1, QUERY_CHUNK // n)
        picks = []
        for i in range(0, b, per):
            j = min(b, i + per)
            per_head = torch.bmm(q[i:j].flatten(1, 2).float(), keys[i:j].float().transpose(1, 2))
            per_head = per_head.relu_().view((j - i) * n, self.heads, e)
            w = (weights[i:j].float() * scale).view((j - i) * n, 1, self.heads)
            scores = torch.bmm(w, per_head).view(j - i, n, e)
            if seen_by_all < e:
                scores[..., seen_by_all:].masked_fill_(unseen >= counts[i:j, :, None], NEG_INF)
            picks.append(topk_indices(scores, self.topk))
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
        out = torch.empty_like(q)
        if batch.decodes is not None:
            d = batch.decodes
            out[d.rows] = self._attend_decodes(d, q, kv, projected, index_inputs, cache)
        for seq in batch.chunks:
            rows = slice(seq.q_start, seq.q_start + seq.num_tokens)
            self._attend(seq, rows, q, kv, positions, projected, index_inputs, cache, out[rows])
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

    def _attend(
        self,
        seq: V4SeqMeta,
        rows: slice,
        q,
        kv,
        positions,
        projected,
        index_inputs,
        cache: V4Cache,
        out: torch.Tensor,
    ) -> None:
        """One request's chunk of n tokens (prefill, chunked prefill or replay), into out."""
        n, start = seq.num_tokens, seq.start
        q, kv, pos = q[rows], kv[rows], positions[rows]
        ring = cache.swa[self.layer][seq.swa_block]
        prev = min(start - seq.window_floor, self.window - 1)
        before = ring.index_select(
            0, torch.arange(start - prev, start, device=kv.device) % cache.ring
        )
        tiles = WindowTiles.build(before.to(kv.dtype), kv, self.window, self.heads)
        keep = min(n, cache.ring)
        ring.index_copy_(0, pos[-keep:] % cache.ring, kv[-keep:].to(ring.dtype))
        entries = None
        if self.compressor is not None:
            entries = self._chunk_entries(seq, rows, kv.dtype, projected, index_inputs, cache)
        if tiles.padded > n:
            q = torch.cat((q, q.new_zeros(tiles.padded - n, *q.shape[1:])))
        step = max(1, QUERY_CHUNK // tiles.tile)
        for first in range(0, tiles.padded // tiles.tile, step):
            last = min(first + step, tiles.padded // tiles.tile)
            lo, hi = first * tiles.tile, min(n, last * tiles.tile)
            window = tiles.logits(q[lo : last * tiles.tile], first, last)
            parts = [window[: hi - lo]]
            if entries is not None:
                keys, logits = self._chunk_compressed(entries, q[lo:hi], pos[lo:hi], lo, start + lo)
                parts.append(logits)
            norm = sink_softmax_(parts, self.sinks.float())
            o = tiles.values(window, first, last)[: hi - lo]
            if entries is not None:
                o += part_values(logits, keys)
            torch.mul(o, norm, out=out[lo:hi])

    def _chunk_entries(
        self, seq: V4SeqMeta, rows: slice, dtype: torch.dtype, projected, index_inputs, cache
    ) -> ChunkEntries | None:
        """Feed the chunk to the compressors (not on replay), then the entries it may see."""
        entry_rows = seq.entry_rows[self.kind]
        st = cache.layers[self.layer]
        if not seq.replay:
            self.compressor.update(
                projected[0][rows],
                projected[1][rows],
                seq.start,
                st,
                seq.state_block,
                entry_rows,
                self.compress_rope,
            )
            if self.indexer is not None:
                self.indexer.compressor.update(
                    index_inputs[2][rows],
                    index_inputs[3][rows],
                    seq.start,
                    cache.indexers[self.layer],
                    seq.state_block,
                    entry_rows,
                    self.compress_rope,
                )
        if not entry_rows.numel():
            return None
        storage = st.entries.view(-1, self.head_dim)
        if self.indexer is None or entry_rows.numel() <= self.indexer.topk:
            return ChunkEntries(self.rate, storage.index_select(0, entry_rows).to(dtype))
        index_storage = cache.indexers[self.layer].entries.view(-1, self.indexer.dim)
        index_keys = index_storage.index_select(0, entry_rows)
        return ChunkEntries(
            self.rate,
            dense=None,
            storage=storage,
            rows=entry_rows,
            index_keys=index_keys,
            index_q=index_inputs[0][rows],
            index_weights=index_inputs[1][rows],
        )

    def _chunk_compressed(
        self, entries: ChunkEntries, q: torch.Tensor, pos: torch.Tensor, lo: int, first_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and logits of queries [lo, lo + len(q)) of a chunk over its compressed
        entries; first_pos: the position of query lo."""
        seen = (pos + 1) // entries.rate
        seen_by_first = (first_pos + 1) // entries.rate
        if entries.dense is not None:
            count = entries.dense.shape[0]
            blocked = None
            if seen_by_first < count:
                blocked = (torch.arange(count, device=q.device) >= seen[:, None])[:, None, :]
            return entries.dense, part_logits(q, entries.dense, blocked)
        hi = lo + q.shape[0]
        picks = self.indexer.select(
            entries.index_q[lo:hi][None],
            entries.index_weights[lo:hi][None],
            entries.index_keys[None],
            seen[None],
            seen_by_first,
        )[0]
        keys = gather_rows(entries.storage, entries.rows[picks]).to(q.dtype)
        blocked = None if seen_by_first >= self.indexer.topk else (picks >= seen[:, None])[:, None]
        return keys, part_logits(q, keys, blocked)

    def _attend_decodes(
        self, d: V4Decodes, q, kv, projected, index_inputs, cache: V4Cache
    ) -> torch.Tensor:
        """Every one-token step of the batch at once: windows from the rings, then the
        compressed entries (padded to the longest request, or the indexer's top-k)."""
        ring = cache.swa[self.layer].view(-1, self.head_dim)
        ring.index_copy_(0, d.new_rows, kv[d.rows].to(ring.dtype))
        window = gather_rows(ring, d.window_rows).to(kv.dtype)  # [B, W, D], the new token last
        q = q[d.rows]
        blocked = None if d.window_padding is None else d.window_padding[:, None, :]
        parts = [(window, part_logits(q, window, blocked))]
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
            if e.longest:
                parts.append(self._decode_compressed(e, q, d.rows, index_inputs, cache))
        norm = sink_softmax_([logits for _, logits in parts], self.sinks.float())
        out = part_values(parts[0][1], parts[0][0])
        for keys, logits in parts[1:]:
            out += part_values(logits, keys)
        return out * norm

    def _decode_compressed(
        self, e: DecodeEntries, q: torch.Tensor, rows, index_inputs, cache: V4Cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, L, D] and logits [B, H, L] of the batched decodes' compressed entries."""
        storage = cache.layers[self.layer].entries.view(-1, self.head_dim)
        if self.indexer is None or e.longest <= self.indexer.topk:
            keys = gather_rows(storage, e.rows).to(q.dtype)
            blocked = None if e.padding is None else e.padding[:, None, :]
            return keys, part_logits(q, keys, blocked)
        index_storage = cache.indexers[self.layer].entries.view(-1, self.indexer.dim)
        index_keys = gather_rows(index_storage, e.rows)
        picks = self.indexer.select(
            index_inputs[0][rows][:, None],
            index_inputs[1][rows][:, None],
            index_keys,
            e.counts[:, None],
            e.shortest,
        )[:, 0]
        keys = gather_rows(storage, e.rows.gather(1, picks)).to(q.dtype)
        blocked = None
        if e.shortest < self.indexer.topk:
            blocked = (picks >= e.counts[:, None])[:, None, :]
        return keys, part_logits(q, keys, blocked)


@dataclass
class ChunkEntries:
    """The compressed entries one chunk attends: all of them (`dense`, [E, D]) or, for CSA
    with more than k, the indexer's top-k per query, gathered from `storage` by `rows`."""

    rate: int
    dense: torch.Tensor | None
    storage: torch.Tensor | None = None  # the layer's entries.view(-1, D)
    rows: torch.Tensor | None = None  # [E] the request's entry rows
    index_keys: torch.Tensor | None = None  # [E, index dim]
    index_q: torch.Tensor | None = None  # [n, index heads, index dim]
    index_weights: torch.Tensor | None = None  # [n, index heads]
