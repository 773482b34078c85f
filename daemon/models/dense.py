"""Dense decoder-only transformers: the Llama / Qwen2 / Qwen3 family.

GQA with fused qkv and gate/up projections, RoPE with the config's scaling,
Qwen2 qkv bias, Qwen3 per-head q/k RMSNorm, tied or untied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from daemon.kv.spec import FullAttentionSpec, KVGroup
from daemon.models.attention import AttentionBatch, PagedKVCache, paged_attention
from daemon.models.compiled import CompiledDecode
from daemon.models.fused_decode import FusedDecode
from daemon.models.graphs import PagedDecodeGraphs
from daemon.models.layers import Linear, RMSNorm, column_major, silu_and_mul
from daemon.models.rope import RotaryEmbedding, rope_parameters
from kernels import packed_linear


@dataclass
class DenseConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict[str, Any]

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> DenseConfig:
        model_type = c["model_type"]
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported")
        layer_types = c.get("layer_types") or []
        sliding = c.get("use_sliding_window", False) or any(
            t != "full_attention" for t in layer_types
        )
        if sliding:
            raise ValueError("sliding-window layers of dense models are not supported")
        heads = c["num_attention_heads"]
        attention_bias = c.get("attention_bias", False)
        return cls(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=c.get("mlp_bias", False),
            qk_norm=model_type == "qwen3",
            rope=rope_parameters(c),
        )


class Attention(nn.Module):
    def __init__(self, cfg: DenseConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        q, k, v = self.project(x, positions)
        return self.o_proj(self.attend(q, k, v, batch, kv_cache))

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of the normed input, RoPE applied."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope.apply(q, positions), self.rope.apply(k, positions), v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Writes k, v to the cache; the heads' outputs [T, Hq * D] (before o_proj)."""
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale)
        return o.reshape(q.shape[0], self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, batch, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, batch, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    # the same layer in two halves, for the compiled CPU forward's steps with prefill chunks
    # (their attention runs eagerly between the halves)

    def attention_in(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to its attention: q, k, v of the normed input."""
        return self.self_attn.project(self.input_layernorm(x), positions)

    def attention_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The layer after its attention (`o`: the heads' outputs): o_proj, the residual, MLP."""
        x = x + self.self_attn.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseForCausalLM(nn.Module):
    # checkpoint projection name -> (our fused parameter, shard index)
    STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    head_packed = False  # the logits' weight (`after_load`)

    def __init__(self, cfg: DenseConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        rope = RotaryEmbedding(
            int(cfg.head_dim * cfg.rope.get("partial_rotary_factor", 1.0)),
            cfg.max_position_embeddings,
            cfg.rope,
            device,
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(column_major(cfg.vocab_size, cfg.hidden_size))

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_position_embeddings

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def kv_groups(self, dtype: torch.dtype, block_size: int) -> list[KVGroup]:
        spec = FullAttentionSpec(
            block_size, self.cfg.num_layers, dtype, self.cfg.num_kv_heads, self.cfg.head_dim
        )
        return [KVGroup(spec, tuple(range(self.cfg.num_layers)))]

    def allocate_cache(
        self,
        groups: list[KVGroup],
        num_blocks: list[int],
        device: torch.device,
        graph_batch: int = 0,
    ) -> PagedKVCache:
        return PagedKVCache(groups[0].spec, num_blocks[0], device)

    def decode_graphs(
        self, cache: PagedKVCache, device: torch.device, max_batch: int
    ) -> PagedDecodeGraphs | CompiledDecode:
        if device.type == "cpu":
            return CompiledDecode(self, cache, max_batch, FusedDecode.of(self, cache))
        return PagedDecodeGraphs(self, cache, device, max_batch)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        return self.forward_layers(input_ids, positions, batch, cache, self.cfg.num_layers)

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
        num_layers: int,
    ) -> torch.Tensor:
        """The first `num_layers` layers, then the final norm (layer skipping drafts from these
        rows through `compute_logits`)."""
        return self.forward_embedded(
            self.embed_tokens(input_ids), positions, batch, cache, num_layers
        )

    def forward_embedded(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
        num_layers: int,
    ) -> torch.Tensor:
        """`forward_layers` from input embeddings `x` (a multimodal model's spliced rows)."""
        for layer, kv in zip(self.layers[:num_layers], cache.layers):
            x = layer(x, positions, batch, kv)
        return self.norm(x)

    def after_load(self) -> None:
        """Every linear weight packed where packing pays on this CPU (`Linear.pack`), the
        logits' too (the embedding's where tied)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is not None:
            self.head_packed = self.lm_head.packed
        else:
            self.head_packed = packed_linear.pack(self.embed_tokens.weight)

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        weight = self._head_weight()
        if self.head_packed:
            logits = packed_linear.linear(hidden, weight, None)
        else:
            logits = hidden @ weight.t()
        return logits.float() if upcast else logits

    def checkpoint_to_param(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter name (and shard) for a checkpoint tensor; None = not a parameter."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: some checkpoints still ship the copy
        for ckpt, (fused, shard) in self.STACKED.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{fused}."), shard
        return name, None

    def shard_sizes(self, param: str) -> list[int] | None:
        """Row sizes of the checkpoint tensors fused into `param`; None = not fused."""
        if ".qkv_proj." in param:
            a = self.layers[0].self_attn
            return [a.q_size, a.kv_size, a.kv_size]
        if ".gate_up_proj." in param:
            return [self.cfg.intermediate_size] * 2
        return None

    def param_parts(self, param: str) -> list[int | None]:
        sizes = self.shard_sizes(param)
        return list(range(len(sizes))) if sizes else [None]

    def param_view(self, name: str, param: torch.Tensor, part: int | None) -> torch.Tensor:
        if part is None:
            return param
        sizes = self.shard_sizes(name)
        assert sizes is not None
        return param.narrow(0, sum(sizes[:part]), sizes[part])

    def covered_parts(self, param: str, part: int | None) -> list[int | None]:
        return [part]
