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
        """q [n, heads, dim], weights [n, heads], keys [E, dim], visible [n, E] -> chosen [n, E] bool."""
        scores = F.relu(torch.einsum("nhd,ed->nhe", q.float(), keys.float())) * self.dim**-0.5
        scores = (scores * (weights.float() * self.heads**-0.5).unsqueeze(-1)).sum(dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.topk, keys.shape[0])
        top = scores.topk(k, dim=-1).indices
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, top, True)
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
        for seq in batch.seqs:
            rows = slice(seq.q_start, seq.q_start + seq.num_tokens)
            out[rows] = self._attend(
                seq, rows, q[rows], kv[rows], positions[rows], projected, index_inputs, cache
            )
        out = self.rope.apply(out, cos, sin, inverse=True)
        grouped = self.o_a_proj(out.reshape(t, self.cfg.o_groups, -1)).flatten(1)
        return self.o_b_proj(grouped)

    def _attend(
        self, seq: V4SeqMeta, rows: slice, q, kv, pos, projected, index_inputs, cache: V4Cache
    ) -> torch.Tensor:
        n, start = seq.num_tokens, seq.start
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
            count = (start + n) // self.rate
            entries = Compressor.gather(st, table, count).to(kv.dtype)
            visible = (
                torch.arange(count, device=kv.device)[None, :] < ((pos + 1) // self.rate)[:, None]
            )
            if self.indexer is not None and count:
                iq, iw, ikv, igate = (x[rows] for x in index_inputs)
                ist = cache.indexers[self.layer]
                if not seq.replay:
                    self.indexer.compressor.update(
                        ikv, igate, start, ist, seq.state_block, table, self.compress_rope
                    )
                visible = self.indexer.select(iq, iw, Compressor.gather(ist, table, count), visible)
            elif self.indexer is not None and not seq.replay:
                self.indexer.compressor.update(
                    *(x[rows] for x in index_inputs[2:]),
                    start,
                    cache.indexers[self.layer],
                    seq.state_block,
                    table,
                    self.compress_rope,
                )
            keys = torch.cat((keys, entries))
            mask = torch.cat((mask, visible), dim=1)

        logits = torch.einsum("nhd,ld->hnl", q, keys).float() * self.head_dim**-0.5
        logits = logits.masked_fill(~mask, float("-inf"))
        sinks = self.sinks.float().view(-1, 1, 1).expand(-1, n, 1)
        combined = torch.cat((logits, sinks), dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.einsum("hnl,ld->nhd", probs.to(keys.dtype), keys)
