"""Causal prefill attention on CPU in bf16 or fp32 over oneDNN's batch-reduce GEMM (C++,
csrc/prefill_attention.cpp) as the torch op `deepinfer::prefill_attention`, beside its torch
reference (SDPA with a causal mask)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_build, paged_attention_cpu


def prefill_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D]; k, v [ctx, Hkv, D] -> [n, Hq, D]: token i at position ctx - n + i attends
    the keys up to its own (causal, lower-right)."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.transpose(0, 1)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the op serves these tensors: CPU with AVX-512 (the build needs it), bf16 or fp32
    (bf16 widened to fp32 where the CPU has no AVX512-BF16, which oneDNN's bf16 batch-reduce
    GEMM needs), head_dim a multiple of 32, whole KV-head groups, heads as dense rows (each
    tensor may have its own token stride)."""
    return (
        paged_attention_cpu.ENABLED
        and q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float32)
        and all(t.dtype == q.dtype for t in (k, v, out))
        and q.shape[-1] % 32 == 0
        and q.shape[1] % k.shape[1] == 0
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v, out))
        and cpu_build.has_avx512()
        and cpu_build.available()
    )


torch.library.define(
    "deepinfer::prefill_attention",
    "(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()",
)


@torch.library.register_fake("deepinfer::prefill_attention")
def _(q, k, v, scale, out):
    return None


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """Writes into `out` [n, Hq, D] the attention of q [n, Hq, D] over k, v [ctx, Hkv, D]
    (bf16 or fp32), as `prefill_reference` computes it. Check `supports` first."""
    if not torch.compiler.is_compiling():
        cpu_build.load()
    torch.ops.deepinfer.prefill_attention(q, k, v, scale, out)
