"""Small building blocks shared by model definitions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def column_major(*shape: int) -> torch.Tensor:
    """An uninitialised weight of `shape` [..., out, in] whose last two dims are stored
    transposed. x @ W^T over a few rows of x then streams W in memory order: on CPU (MKL)
    the experts at decode sizes run 1.25x faster, the 32000-wide lm_head 1.25x at 32 rows and
    3x at one; prefill-sized products are about even."""
    *batch, out_features, in_features = shape
    return torch.empty(*batch, in_features, out_features).transpose(-1, -2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # the weight applied in fp32, one rounding to bf16 (transformers rounds twice: 2^-7)
        return (xf * self.weight).to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
