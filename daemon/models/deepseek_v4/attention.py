"""V4 attention over a batch of requests: shared-KV MQA on a sliding window plus, in CSA
and HCA layers, compressed entries (CSA: the lightning indexer's top-k of them), with
learned sinks and the grouped low-rank output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from daemon.models.deepseek_v4.blocks import (
    FP32RMSNorm,
    GroupedLinear,
    InterleavedRope,
    unweighted_rms_norm,
)
from daemon.models.deepseek_v4.cache import V4Batch, V4Cache, V4SeqMeta
from daemon.models.deepseek_v4.compressor import Compressor
from daemon.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config


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
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """q [B, n, heads, dim], weights [B, n, heads], keys [B, E, dim], visible [B, n, E]
        -> the chosen entries [B, n, E] (top-k of the visible by score)."""
        scores = F.relu(torch.einsum("bnhd,bed->bnhe", q.float(), keys.float())) * self.dim**-0.5
        scores = (scores * (weights.float() * self.heads**-0.5).unsqueeze(-1)).sum(dim=2)
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return chosen & visible


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

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: V4Batch, cache: V4Cache
    ) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = self.rope.cos_sin(positions)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(
            self.q_b_proj(q_residual).view(t, self.heads, self.head_dim), self.eps
        )
        q = self.rope.apply(q, cos, sin)
        kv = self.rope.apply(self.kv_norm(self.kv_proj(x)), cos, sin)
        projected = None
        if self.compressor is not None:
            projected = (self.compressor.kv_proj(x), self.compressor.gate_proj(x))
        index_inputs = None
        if self.indexer is not None:
            ccos, csin = self.compress_rope.cos_sin(positions)
            iq = self.indexer.q_b_proj(q_residual).view(t, self.indexer.heads, self.indexer.dim)
            index_inputs = (
                self.compress_rope.apply(iq, ccos, csin),
                self.indexer.weights_proj(x),
                self.indexer.compressor.kv_proj(x),
                self.indexer.compressor.gate_proj(x),
            )
        out = torch.empty_like(q)
        decodes = [s for s in batch.seqs if s.num_tokens == 1 and not s.replay]
        if decodes:
            rows, o = self._attend_decodes(decodes, q, kv, projected, index_inputs, cache)
            out[rows] = o
        for seq in batch.seqs:
            if seq.num_tokens == 1 and not seq.replay:
                continue
            rows = slice(seq.q_start, seq.q_start + seq.num_tokens)
            out[rows] = self._attend(
                seq, rows, q, kv, positions[rows], projected, index_inputs, cache
            )
        out = self.rope.apply(out, cos, sin, inverse=True)
        grouped = self.o_a_proj(out.reshape(t, self.cfg.o_groups, -1)).flatten(1)
        return self.o_b_proj(grouped)

    def _attend(
        self, seq: V4SeqMeta, rows: slice, q, kv, pos, projected, index_inputs, cache: V4Cache
    ):
        """One request's chunk of n tokens (prefill, chunked prefill or replay)."""
        n, start = seq.num_tokens, seq.start
        kv = kv[rows]
        ring = cache.swa[self.layer][seq.swa_block]
        prev = min(start - seq.window_floor, self.window - 1)
        ring_pos = torch.arange(start - prev, start, device=kv.device)
        keys = torch.cat((ring[ring_pos % cache.ring].to(kv.dtype), kv))
        key_pos = torch.arange(start - prev, start + n, device=kv.device)
        keep = min(n, cache.ring)
        ring[pos[-keep:] % cache.ring] = kv[-keep:].to(ring.dtype)
        mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - self.window)
        if self.compressor is not None:
            table = seq.csa_table if self.kind == CSA else seq.hca_table
            st = cache.layers[self.layer]
            if not seq.replay:
                self.compressor.update(
                    projected[0][rows],
                    projected[1][rows],
                    start,
                    st,
                    seq.state_block,
                    table,
                    self.compress_rope,
                )
                if self.indexer is not None:
                    self.indexer.compressor.update(
                        index_inputs[2][rows],
                        index_inputs[3][rows],
                        start,
                        cache.indexers[self.layer],
                        seq.state_block,
                        table,
                        self.compress_rope,
                    )
            count = (start + n) // self.rate
            entries = Compressor.gather(st, table, count).to(kv.dtype)
            visible = (
                torch.arange(count, device=kv.device)[None, :] < ((pos + 1) // self.rate)[:, None]
            )
            if self.indexer is not None and count:
                index_keys = Compressor.gather(cache.indexers[self.layer], table, count)
                visible = self.indexer.select(
                    index_inputs[0][rows][None],
                    index_inputs[1][rows][None],
                    index_keys[None],
                    visible[None],
                )[0]
            keys = torch.cat((keys, entries))
            mask = torch.cat((mask, visible), dim=1)
        return self._sink_attention(q[rows][None], keys[None], mask[None])[0]

    def _attend_decodes(
        self, seqs: list[V4SeqMeta], q, kv, projected, index_inputs, cache: V4Cache
    ):
        """Every one-token step of the batch at once: windows from the rings, compressed
        entries padded to the longest request."""
        dev = kv.device
        rows = torch.tensor([s.q_start for s in seqs], device=dev)
        starts = [s.start for s in seqs]
        t = torch.tensor(starts, device=dev)
        ring = cache.swa[self.layer]
        swa_blocks = torch.tensor([s.swa_block for s in seqs], device=dev)
        key_pos = t[:, None] + torch.arange(1 - self.window, 0, device=dev)[None, :]  # [B, W-1]
        prev = ring[swa_blocks[:, None], key_pos.clamp(min=0) % cache.ring].to(kv.dtype)
        new_kv = kv[rows]
        keys = torch.cat((prev, new_kv[:, None]), dim=1)
        mask = torch.cat((key_pos >= 0, torch.ones_like(t, dtype=torch.bool)[:, None]), dim=1)
        ring[swa_blocks, t % cache.ring] = new_kv.to(ring.dtype)
        if self.compressor is not None:
            tables = [s.csa_table if self.kind == CSA else s.hca_table for s in seqs]
            state_blocks = [s.state_block for s in seqs]
            st = cache.layers[self.layer]
            self.compressor.update_decode(
                projected[0][rows],
                projected[1][rows],
                starts,
                st,
                state_blocks,
                tables,
                self.compress_rope,
            )
            counts = [(p + 1) // self.rate for p in starts]
            entries, visible = Compressor.gather_padded(st, tables, counts)
            if self.indexer is not None:
                ist = cache.indexers[self.layer]
                self.indexer.compressor.update_decode(
                    index_inputs[2][rows],
                    index_inputs[3][rows],
                    starts,
                    ist,
                    state_blocks,
                    tables,
                    self.compress_rope,
                )
                if entries.shape[1]:
                    index_keys, _ = Compressor.gather_padded(ist, tables, counts)
                    visible = self.indexer.select(
                        index_inputs[0][rows][:, None],
                        index_inputs[1][rows][:, None],
                        index_keys,
                        visible[:, None],
                    )[:, 0]
            keys = torch.cat((keys, entries.to(kv.dtype)), dim=1)
            mask = torch.cat((mask, visible), dim=1)
        return rows, self._sink_attention(q[rows][:, None], keys, mask[:, None])[:, 0]

    def _sink_attention(
        self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [B, n, H, D], keys (= values) [B, L, D], mask [B, n, L] -> [B, n, H, D].
        One softmax over the keys and a learned per-head sink column, which is dropped."""
        logits = torch.einsum("bnhd,bld->bhnl", q, keys).float() * self.head_dim**-0.5
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        b, h, n, _ = logits.shape
        sinks = self.sinks.float().view(1, h, 1, 1).expand(b, h, n, 1)
        combined = torch.cat((logits, sinks), dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.einsum("bhnl,bld->bnhd", probs.to(keys.dtype), keys)
