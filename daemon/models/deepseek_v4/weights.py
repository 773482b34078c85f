"""Checkpoint tensor names of DeepSeek-V4 -> our parameters.

Three spellings occur: Hugging Face module names (`self_attn.q_a_proj`, stacked
`mlp.experts.gate_up_proj`), DeepSeek's original names (`attn.wq_a`,
`ffn.experts.j.w1`, `embed`, `head`), and what transformers' save_pretrained writes
(the original names under a `model.` prefix, experts unstacked).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

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


_HC_SCALE = re.compile(r"(^|\.)(\w*hc|hc_\w*)\.scale$")


def is_scale(name: str) -> bool:
    """FP8 block scales travel beside their weight: DeepSeek's `x.scale` (for `x.weight`) or
    Hugging Face's `x.weight_scale_inv` (stacked experts: `experts.gate_up_proj_scale_inv`).
    The hyper-connection parameters `attn_hc.scale` / `ffn_hc.scale` are real tensors."""
    if name.endswith("_scale_inv"):
        return True
    return name.endswith(".scale") and _HC_SCALE.search(name) is None


def weight_of_scale(name: str) -> str:
    if name.endswith("_scale_inv"):
        return name[: -len("_scale_inv")]
    return name[: -len("scale")] + "weight"


def describe_part(part: Part) -> str:
    """A readable name for a part of a fused parameter, for load errors."""
    if part[0] == "expert":
        which = {None: "w2 (down)", 0: "w1 (gate)", 1: "w3 (up)"}[part[2]]
        return f"expert {part[1]} {which}"
    if part[0] == "rows":
        return ("w1 (gate)", "w3 (up)")[part[1]]
    return " ".join(str(p) for p in part)


def mtp_key(name: str) -> str:
    """`mtp.0.e_proj.weight` -> the key it has in the model's `mtp` ParameterDict."""
    return name.replace(".", "__")


def mtp_weights(mtp: nn.ParameterDict) -> dict[str, torch.Tensor]:
    """The multi-token-prediction tensors a checkpoint held, under their checkpoint names
    (`mtp.0.enorm.weight`, ..., without a `model.` prefix; FP8 weights dequantized)."""
    return {key.replace("__", "."): value for key, value in mtp.items()}


def checkpoint_target(name: str, cfg: V4Config) -> tuple[str, Part] | None:
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("mtp."):
        return name, None  # kept aside by the loader, for speculative decoding
    if ".rotary_emb." in name or name.startswith("rotary_emb."):
        return None  # derived from the config; some exports include these buffers
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


def hf_state_dict(model) -> dict:
    """Our parameters under Hugging Face's DeepseekV4ForCausalLM names (stacked experts)."""
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("mtp."):
            continue
        hf = name if name == "lm_head.weight" else "model." + name
        hf = hf.replace(".self_attn.indexer.compressor.", ".self_attn.compressor.indexer.")
        hf = hf.replace(
            ".self_attn.indexer.weights_proj.", ".self_attn.compressor.indexer.scorer.weights_proj."
        )
        hf = hf.replace(".self_attn.indexer.q_b_proj.", ".self_attn.compressor.indexer.q_b_proj.")
        hf = hf.replace(".mlp.gate_up_proj", ".mlp.experts.gate_up_proj").replace(
            ".mlp.down_proj", ".mlp.experts.down_proj"
        )
        if hf.endswith("shared_experts.gate_up_proj.weight"):
            gate, up = tensor.detach().chunk(2, dim=0)
            out[hf.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[hf.replace("gate_up_proj", "up_proj")] = up.contiguous()
            continue
        out[hf] = tensor.detach().contiguous()
    return out
