"""Grouped linear over rows sorted by group (MoE experts): a Triton kernel that reads the group
boundaries on the device, so it never syncs with the host and can be captured in a CUDA graph,
next to its torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import triton

if triton is not None:
    import triton.language as tl

BLOCK_ROWS, BLOCK_OUT, BLOCK_IN = 16, 64, 32


def grouped_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """x [N, in] sorted by group, group e = rows ends[e-1]..ends[e]; weight [E, out, in] ->
    [N, out]. One linear per non-empty group (reads `ends` on the host)."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    begin = 0
    for e, end in enumerate(ends.tolist()):
        if end > begin:
            out[begin:end] = F.linear(x[begin:end], weight[e])
        begin = end
    return out


if triton is not None:

    @triton.jit
    def _grouped_linear_kernel(
        x,
        w,
        out,
        ends,
        in_features,
        out_features,
        stride_xn,
        stride_xk,
        stride_we,
        stride_wo,
        stride_wk,
        stride_on,
        stride_oo,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_OUT: tl.constexpr,
        BLOCK_IN: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # program (group, row block, column block); most row blocks of a group are past its
        # end and return at once: the grid depends on shapes only, never on the routing
        group = tl.program_id(0)
        end = tl.load(ends + group)
        begin = tl.where(group > 0, tl.load(ends + tl.maximum(group - 1, 0)), 0)
        first = begin + tl.program_id(1) * BLOCK_ROWS
        if first < end:
            rows = first + tl.arange(0, BLOCK_ROWS)
            cols = tl.program_id(2) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
            row_ok, col_ok = rows < end, cols < out_features
            acc = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=tl.float32)
            for k0 in range(0, in_features, BLOCK_IN):
                ks = k0 + tl.arange(0, BLOCK_IN)
                k_ok = ks < in_features
                a = tl.load(
                    x + rows[:, None] * stride_xn + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w + group * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wo,
                    mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                acc += tl.dot(a, b, input_precision=PRECISION)
            tl.store(
                out + rows[:, None] * stride_on + cols[None, :] * stride_oo,
                acc.to(out.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )


def grouped_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """As `grouped_linear_reference`, with `ends` (int32 or int64) read by the kernel only."""
    n, in_features = x.shape
    groups, out_features, _ = weight.shape
    out = x.new_empty(n, out_features)
    grid = (groups, triton.cdiv(max(n, 1), BLOCK_ROWS), triton.cdiv(out_features, BLOCK_OUT))
    _grouped_linear_kernel[grid](
        x,
        weight,
        out,
        ends,
        in_features,
        out_features,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_OUT=BLOCK_OUT,
        BLOCK_IN=BLOCK_IN,
        # float32: full products, no tf32 (as torch's default matmul); the others' default
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out


if triton is not None:

    @torch.library.custom_op("deepinfer::grouped_linear", mutates_args=())
    def _grouped_linear_op(
        x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor
    ) -> torch.Tensor:
        """`grouped_linear_triton` as a torch op: the fake below gives its shape on "meta"
        (and to torch.compile) without running it."""
        return grouped_linear_triton(x, weight, ends)

    @_grouped_linear_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[1])


def grouped_linear_fused(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The kernel through its torch op (needs Triton)."""
    return torch.ops.deepinfer.grouped_linear(x, weight, ends)
