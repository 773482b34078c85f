"""mHC's mixing matrices in one Triton kernel: the softmax of each token's hc x hc logits, then
Sinkhorn's alternating normalisations, all in registers (the torch version runs two small ops
per half-round, ~80 launches per call for 20 rounds), next to its torch reference."""

from __future__ import annotations

import torch

from kernels import triton

if triton is not None:
    import triton.language as tl

BLOCK_TOKENS = 64


def sinkhorn_reference(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [hc_in, hc_out, T] -> softmax over hc_out, + eps, then columns (sums over hc_in)
    divided by their sum + eps, then `iters - 1` rounds of rows, then columns."""
    comb = torch.softmax(logits.float(), dim=1) + eps
    comb = comb / (comb.sum(0, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(1, keepdim=True) + eps)
        comb = comb / (comb.sum(0, keepdim=True) + eps)
    return comb


if triton is not None:

    @triton.jit
    def _sinkhorn_kernel(
        logits,
        out,
        tokens,
        eps,
        HC: tl.constexpr,
        HC_P: tl.constexpr,
        ITERS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.arange(0, HC_P)[:, None, None]
        j = tl.arange(0, HC_P)[None, :, None]
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[None, None, :]
        inside = (i < HC) & (j < HC) & (t < tokens)
        offsets = (i * HC + j) * tokens + t
        # lanes outside the matrix or past the last token hold zeros, never NaN
        x = tl.load(logits + offsets, mask=inside, other=-1e30).to(tl.float32)
        top = tl.max(x, axis=1, keep_dims=True)
        e = tl.where(inside, tl.exp(x - top), 0.0)
        total = tl.sum(e, axis=1, keep_dims=True)
        c = tl.where(inside, e / tl.where(total > 0, total, 1.0) + eps, 0.0)
        c = c / (tl.sum(c, axis=0, keep_dims=True) + eps)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=1, keep_dims=True) + eps)
            c = c / (tl.sum(c, axis=0, keep_dims=True) + eps)
        tl.store(out + offsets, c, mask=inside)


def sinkhorn_triton(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """As `sinkhorn_reference`, float32 out, for contiguous logits [hc, hc, T]."""
    hc, _, tokens = logits.shape
    logits = logits.contiguous()
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    grid = (triton.cdiv(tokens, BLOCK_TOKENS),)
    _sinkhorn_kernel[grid](
        logits,
        out,
        tokens,
        eps,
        HC=hc,
        HC_P=triton.next_power_of_2(hc),
        ITERS=iters,
        BLOCK=BLOCK_TOKENS,
    )
    return out


if triton is not None:

    @torch.library.custom_op("deepinfer::sinkhorn", mutates_args=())
    def _sinkhorn_op(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """`sinkhorn_triton` as a torch op (a shape-only fake on "meta" and for torch.compile)."""
        return sinkhorn_triton(logits, iters, eps)

    @_sinkhorn_op.register_fake
    def _(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return torch.empty(logits.shape, dtype=torch.float32, device=logits.device)


def sinkhorn_fused(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The kernel through its torch op (needs Triton)."""
    return torch.ops.deepinfer.sinkhorn(logits, iters, eps)
