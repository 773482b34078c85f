"""DeepSeek-V4 settings read from a Hugging Face config.json (current and legacy field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
_RATE_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass
class V4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_limit: float
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_dim: int
    rope_main: dict[str, Any]
    rope_compress: dict[str, Any]
    max_position_embeddings: int
    num_mtp_layers: int
    scoring_func: str
    # the MTP layers' attention kind: the config's entry past the last layer's, if it has one
    mtp_layer_type: str = SLIDING

    @property
    def csa_rate(self) -> int:
        return self.compress_rates[CSA]

    @property
    def hca_rate(self) -> int:
        return self.compress_rates[HCA]

    @property
    def block_tokens(self) -> int:
        """Tokens of one prefix-cache block: at its end every compressor window is closed."""
        return math.lcm(self.csa_rate, self.hca_rate)

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> V4Config:
        n = c["num_hidden_layers"]
        rates = dict(c.get("compress_rates") or {CSA: 4, HCA: 128})
        rates[CSA] = c.get("compress_rate_csa", rates[CSA])
        rates[HCA] = c.get("compress_rate_hca", rates[HCA])
        layer_types = c.get("layer_types")
        if layer_types is None and c.get("compress_ratios") is not None:
            layer_types = [_RATE_TO_TYPE[r] for r in c["compress_ratios"]]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mtp_type = layer_types[n] if len(layer_types) > n else SLIDING
        layer_types = list(layer_types[:n])
        bad = sorted(set(layer_types) - {SLIDING, CSA, HCA})
        if bad:
            raise ValueError(f"unknown DeepSeek-V4 layer types {bad}")
        mlp_types = c.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = c.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = c.get("head_dim", 512)
        prf = c.get("partial_rotary_factor")
        if prf is None:
            prf = c["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in c else 64 / 512
        main, compress = _rope(c, prf)
        scoring = c.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise ValueError(f"scoring_func {scoring!r} is not supported (sqrtsoftplus only)")
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            moe_intermediate_size=c.get("moe_intermediate_size", c.get("intermediate_size", 2048)),
            num_layers=n,
            num_heads=c.get("num_attention_heads", 64),
            head_dim=head_dim,
            q_lora_rank=c.get("q_lora_rank", 1024),
            o_groups=c.get("o_groups", 8),
            o_lora_rank=c.get("o_lora_rank", 1024),
            num_experts=c.get("n_routed_experts", c.get("num_local_experts", 256)),
            num_experts_per_tok=c.get("num_experts_per_tok", 6),
            routed_scaling_factor=c.get("routed_scaling_factor", 1.5),
            swiglu_limit=c.get("swiglu_limit", 10.0),
            layer_types=layer_types,
            mlp_layer_types=list(mlp_types[:n]),
            compress_rates=rates,
            sliding_window=c.get("sliding_window", 128),
            index_n_heads=c.get("index_n_heads", 64),
            index_head_dim=c.get("index_head_dim", 128),
            index_topk=c.get("index_topk", 512),
            hc_mult=c.get("hc_mult", 4),
            hc_sinkhorn_iters=c.get("hc_sinkhorn_iters", 20),
            hc_eps=c.get("hc_eps", 1e-6),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_dim=int(head_dim * prf),
            rope_main=main,
            rope_compress=compress,
            max_position_embeddings=c.get("max_position_embeddings", 1048576),
            num_mtp_layers=c.get("num_nextn_predict_layers", 0),
            scoring_func=scoring,
            mtp_layer_type=mtp_type,
        )


def _rope(c: dict[str, Any], prf: float) -> tuple[dict[str, Any], dict[str, Any]]:
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp["main"]), dict(rp["compress"])
    main = {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
    compress = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    compress["rope_theta"] = c.get("compress_rope_theta", 160000.0)
    compress["rope_type"] = compress.pop("type", compress.get("rope_type", "default"))
    if compress["rope_type"] == "yarn":
        # The reference does not scale cos/sin by YaRN's mscale on V4.
        compress.setdefault("attention_factor", 1.0)
    return main, compress
