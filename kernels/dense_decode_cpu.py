"""A decode step through every layer of a Llama-style decoder in one C++ call on a CPU
(csrc/dense_decode.cpp) as the torch op `deepinfer::dense_decode_layers`; its reference is the
model's own eager layer (tests/test_dense_decode.py)."""

from __future__ import annotations

import os

import torch

from kernels import cpu_build

# DEEPINFER_CPU_KERNELS=0: `available` says no (read once, at import)
ENABLED = os.environ.get("DEEPINFER_CPU_KERNELS", "1") != "0"


def available() -> bool:
    """Whether the op can run here (the kernels built; the op's schema is the library's)."""
    return ENABLED and cpu_build.available()


def dense_decode_layers(
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    weights: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """x [T, hidden]: the embedded tokens of T decodes (one each) at `positions`, whose K and V
    go to cache `slots`; `tables` [T, blocks] and `lens` [T] as `paged_decode_attention`'s;
    per layer its caches [slots, Hkv, D] and six weights: input norm, qkv, o, post-attention
    norm, gate/up, down (no biases); cos / sin [positions, D / 2] float32 (full rotary). The
    hidden states [T, hidden] after the last layer (before the final norm); the caches are
    written."""
    return torch.ops.deepinfer.dense_decode_layers(
        x,
        positions,
        slots,
        tables,
        lens,
        k_caches,
        v_caches,
        weights,
        cos,
        sin,
        num_heads,
        num_kv_heads,
        eps,
        scale,
        block_size,
    )
