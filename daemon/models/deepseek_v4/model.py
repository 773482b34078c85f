"""DeepSeek-V4 causal LM over the engine's flat token batch."""

from __future__ import annotations

import torch
from torch import nn

from daemon.kv.spec import KVGroup
from daemon.models.deepseek_v4 import kv as v4kv
from daemon.models.deepseek_v4.attention import V4Attention
from daemon.models.deepseek_v4.batch import V4Batch
from daemon.models.deepseek_v4.blocks import (
    FP32RMSNorm,
    HyperConnection,
    HyperHead,
    InterleavedRope,
    MoE,
)
from daemon.models.deepseek_v4.cache import V4Cache
from daemon.models.deepseek_v4.config import V4Config
from daemon.models.deepseek_v4.graphs import V4Buckets, V4DecodeGraphs
from daemon.models.deepseek_v4.weights import Part, checkpoint_target
from daemon.models.layers import column_major


class V4DecoderLayer(nn.Module):
    def __init__(
        self, cfg: V4Config, layer: int, rope_main: InterleavedRope, rope_compress: InterleavedRope
    ) -> None:
        super().__init__()
        self.self_attn = V4Attention(cfg, layer, rope_main, rope_compress)
        self.mlp = MoE(cfg, hashed=cfg.mlp_layer_types[layer] == "hash_moe")
        self.input_layernorm = FP32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = FP32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(
        self, streams, input_ids, positions, batch: V4Batch, cache: V4Cache
    ) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), positions, batch, cache)
        streams = HyperConnection.expand(post, comb, out, streams)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids, batch.counted)
        return HyperConnection.expand(post, comb, out, streams)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: V4Config, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.device("cpu"):
            rope_main = InterleavedRope(
                cfg.rope_dim, cfg.rope_main, cfg.max_position_embeddings, device
            )
            rope_compress = InterleavedRope(
                cfg.rope_dim, cfg.rope_compress, cfg.max_position_embeddings, device
            )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            V4DecoderLayer(cfg, i, rope_main, rope_compress) for i in range(cfg.num_layers)
        )
        self.hc_head = HyperHead(cfg)
        self.norm = FP32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(column_major(cfg.vocab_size, cfg.hidden_size))
        # multi-token-prediction weights, kept as loaded for speculative decoding
        self.mtp = nn.ParameterDict()

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_position_embeddings

    def kv_groups(self, dtype: torch.dtype, block_size: int) -> list[KVGroup]:
        return v4kv.kv_groups(self.cfg, dtype)

    def allocate_cache(
        self,
        groups: list[KVGroup],
        num_blocks: list[int],
        device: torch.device,
        graph_batch: int = 0,
    ) -> V4Cache:
        """With `graph_batch`, the cache pads decode-only steps to the decode graphs' shapes."""
        shapes = (
            V4Buckets.up_to(graph_batch, self.cfg.block_tokens, self.max_model_len)
            if graph_batch
            else None
        )
        return V4Cache(self.cfg, groups, num_blocks, device, shapes)

    def decode_graphs(
        self, cache: V4Cache, device: torch.device, max_batch: int
    ) -> V4DecodeGraphs | None:
        return V4DecodeGraphs(self, cache, device) if device.type == "cuda" else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: V4Batch, cache: V4Cache
    ) -> torch.Tensor:
        if batch.fresh_states is not None:
            cache.reset_requests(batch.fresh_states)
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, batch, cache)
        return streams

    def compute_logits(self, streams: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Residual streams [N, hc, D] of the rows to sample (the forward returns every row's)
        -> fp32 logits (`upcast` or not): the head's collapse and norm run on these rows
        only."""
        return self.lm_head(self.norm(self.hc_head(streams))).float()

    # ---- checkpoint loading -------------------------------------------------------------

    def checkpoint_to_param(self, name: str) -> tuple[str, Part] | None:
        return checkpoint_target(name, self.cfg)

    def param_parts(self, param: str) -> list[Part]:
        """Every part a complete checkpoint must fill in `param`."""
        if param.endswith("mlp.gate_up_proj"):
            return [("expert", e, s) for e in range(self.cfg.num_experts) for s in (0, 1)]
        if param.endswith("mlp.down_proj"):
            return [("expert", e, None) for e in range(self.cfg.num_experts)]
        if param.endswith("shared_experts.gate_up_proj.weight"):
            return [("rows", 0), ("rows", 1)]
        return [None]

    def covered_parts(self, param: str, part: Part) -> list[Part]:
        return self.param_parts(param) if part == ("stacked",) else [part]

    def param_view(self, name: str, param: torch.Tensor, part: Part) -> torch.Tensor:
        if part is None:
            return param
        if part[0] == "expert":
            view = param[part[1]]
            if part[2] is None:
                return view
            half = view.shape[0] // 2
            return view[part[2] * half : (part[2] + 1) * half]
        if part[0] == "rows":
            half = param.shape[0] // 2
            return param[part[1] * half : (part[1] + 1) * half]
        if part[0] == "stacked":  # a whole [E, ...] tensor in Hugging Face's stacked layout
            return param
        raise ValueError(f"unknown weight part {part!r}")
