"""A dense model's decode-only steps through one C++ op over all its layers
(`kernels.dense_decode_cpu`): no graph wrapper, boxed call or Python per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from daemon.models.attention import AttentionBatch, PagedKVCache
from kernels import dense_decode_cpu, paged_attention_cpu


@dataclass
class FusedDecode:
    """The op's fixed arguments, gathered once: the weights and caches are the model's and the
    cache's own tensors (read at each call, so a weight written in place is seen)."""

    weights: list[torch.Tensor]
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    block_size: int

    @classmethod
    def of(cls, model: nn.Module, cache: PagedKVCache) -> FusedDecode | None:
        """For a dense model the op serves: CPU, fp32 or bf16, no biases, no q/k norms, full
        rotary, the kernels built; else None (the compiled layer serves it)."""
        cfg, layers = model.cfg, model.layers
        attn = layers[0].self_attn
        k = cache.layers[0][0]
        q_probe = torch.empty(0, cfg.num_heads, cfg.head_dim, dtype=k.dtype, device=k.device)
        if (
            cfg.qkv_bias
            or cfg.o_bias
            or cfg.mlp_bias
            or cfg.qk_norm
            or attn.rope.rotary_dim != cfg.head_dim
            or not paged_attention_cpu.supports(q_probe, k)  # fp32 or bf16 among its terms
            or not dense_decode_cpu.available()
        ):
            return None
        weights = []
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            weights += [
                layer.input_layernorm.weight,
                a.qkv_proj.weight,
                a.o_proj.weight,
                layer.post_attention_layernorm.weight,
                mlp.gate_up_proj.weight,
                mlp.down_proj.weight,
            ]
        return cls(
            weights=[w.detach() for w in weights],
            k_caches=[kv[0] for kv in cache.layers],
            v_caches=[kv[1] for kv in cache.layers],
            cos=attn.rope.cos,
            sin=attn.rope.sin,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            eps=cfg.rms_norm_eps,
            scale=attn.scale,
            block_size=cache.block_size,
        )

    def run(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The hidden states [T, hidden] after the last layer of a decode-only step's embedded
        tokens `x`; writes their K and V."""
        return dense_decode_cpu.dense_decode_layers(
            x,
            positions,
            batch.slot_mapping,
            batch.decode_tables,
            batch.context_lens(),
            self.k_caches,
            self.v_caches,
            self.weights,
            self.cos,
            self.sin,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.block_size,
        )
