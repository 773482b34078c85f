"""Rotary position embeddings with the scaling schemes of Hugging Face configs
(default, linear, llama3, yarn), as cos/sin tables indexed by position."""

from __future__ import annotations

import math
from typing import Any

import torch


class UnsupportedRope(ValueError):
    pass


def _inv_freq_default(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    dim: int, base: float, p: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_positions / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope dict of a v5 config (`rope_parameters`) or a v4 one (`rope_scaling` + `rope_theta`)."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def inv_freq_and_scaling(
    rotary_dim: int, params: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of `rotary_dim // 2` channel pairs and the cos/sin scale."""
    with torch.device("cpu"):  # models are built under a meta-device context
        rope_type = params.get("rope_type", "default")
        base = float(params["rope_theta"])
        if rope_type == "default":
            return _inv_freq_default(rotary_dim, base), 1.0
        if rope_type == "linear":
            return _inv_freq_default(rotary_dim, base) / params["factor"], 1.0
        if rope_type == "llama3":
            return _llama3(_inv_freq_default(rotary_dim, base), params), 1.0
        if rope_type == "yarn":
            return _yarn(rotary_dim, base, params, max_positions)
    raise UnsupportedRope(f"rope_type {rope_type!r} is not supported")


def cos_sin_tables(
    rotary_dim: int, max_positions: int, params: dict[str, Any], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_positions, rotary_dim // 2], float32."""
    inv_freq, scaling = inv_freq_and_scaling(rotary_dim, params, max_positions)
    with torch.device("cpu"):
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        return (freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device)


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions); applies the half-rotation layout."""

    def __init__(
        self, rotary_dim: int, max_positions: int, params: dict[str, Any], device: torch.device
    ) -> None:
        self.cos, self.sin = cos_sin_tables(rotary_dim, max_positions, params, device)
        self.rotary_dim = rotary_dim

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; rotates the first `rotary_dim` dims in float32."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.float().chunk(2, dim=-1)
        c1, s1 = cos, sin
        out = torch.cat((x1 * c1 - x2 * s1, x2 * c1 + x1 * s1), dim=-1).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.numel() else out
