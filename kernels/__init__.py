"""Accelerator kernels next to their torch reference versions."""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:  # an optional extra: the references run everywhere
    triton = None


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on `device`: CUDA with Triton installed, and
    "meta" (shape-only runs, through the kernels' fake implementations)."""
    return triton is not None and device.type in ("cuda", "meta")
