"""Checkpoint tensor names of DeepSeek-V4 -> our parameters.

Three spellings occur: Hugging Face module names (`self_attn.q_a_proj`, stacked
`mlp.experts.gate_up_proj`), DeepSeek's original names (`attn.wq_a`,
`ffn.experts.j.w1`, `embed`, `head`), and what transformers' save_pretrained writes
(the original names under a `model.` prefix, experts unstacked).
"""

from __future__ import annotations

import re
from typing import Any

from daemon.models.deepseek_v4.config import V4Config

Part = Any  # None = the whole tensor, or ("expert", e, half), ("rows", half), ("stacked",)

_TOP = {
    "embed.weight": "embed_tokens.weight",
    "embed_tokens.weight": "embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
    "hc_head.hc_fn": "hc_head.hc_fn",
    "hc_head.hc_base": "hc_head.hc_base",
    "hc_head.hc_scale": "hc_head.hc_scale",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.indexer.wq_b.weight": "self_attn.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "self_attn.indexer.q_b_proj.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.down_proj.weight",
}
_COMPRESSOR = {
    "wkv.weight": "kv_proj.weight",
    "wgate.weight": "gate_proj.weight",
    "ape": "position_bias",
    "norm.weight": "kv_norm.weight",
    "kv_proj.weight": "kv_proj.weight",
    "gate_proj.weight": "gate_proj.weight",
    "position_bias": "position_bias",
    "kv_norm.weight": "kv_norm.weight",
}
_COMPRESSOR_PREFIXES = {
    "attn.indexer.compressor.": "self_attn.indexer.compressor.",
    "self_attn.compressor.indexer.": "self_attn.indexer.compressor.",
    "attn.compressor.": "self_attn.compressor.",
    "self_attn.compressor.": "self_attn.compressor.",
}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_SHARED = {
    "ffn.shared_experts.w1.weight": 0,
    "ffn.shared_experts.w3.weight": 1,
    "mlp.shared_experts.gate_proj.weight": 0,
    "mlp.shared_experts.up_proj.weight": 1,
}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def is_scale(name: str) -> bool:
    """FP8 block scales travel beside their weight: `x.scale` or `x.weight_scale_inv`."""
    return (
        name.endswith(".scale")
        and not name.endswith("hc.scale")
        or name.endswith("weight_scale_inv")
    )


def weight_of_scale(name: str) -> str:
    if name.endswith("weight_scale_inv"):
        return name[: -len("_scale_inv")]
    return name[: -len("scale")] + "weight"


def checkpoint_target(name: str, cfg: V4Config) -> tuple[str, Part] | None:
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("mtp."):
        return name, None  # kept aside by the loader, for speculative decoding
    if name in _TOP:
        return _TOP[name], None
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        return name, None  # unknown: the loader reports it
    layer, rest = match.group(1), match.group(2)
    prefix = f"layers.{layer}."
    if rest in _LAYER:
        return prefix + _LAYER[rest], None
    if rest in _SHARED:
        return prefix + "mlp.shared_experts.gate_up_proj.weight", ("rows", _SHARED[rest])
    expert = _EXPERT.fullmatch(rest)
    if expert:
        e, w = int(expert.group(1)), expert.group(2)
        if w == "w2":
            return prefix + "mlp.down_proj", ("expert", e, None)
        return prefix + "mlp.gate_up_proj", ("expert", e, 0 if w == "w1" else 1)
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return prefix + "mlp." + rest.split(".")[-1], ("stacked",)
    for old, new in _COMPRESSOR_PREFIXES.items():
        if rest.startswith(old) and rest[len(old) :] in _COMPRESSOR:
            return prefix + new + _COMPRESSOR[rest[len(old) :]], None
    return prefix + rest, None  # Hugging Face names equal ours elsewhere
