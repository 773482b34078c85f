"""The Triton mHC mixing kernel (softmax + Sinkhorn in registers) against its torch reference
and against the model's bordered-buffer Sinkhorn, in float32 (Triton's interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

from daemon.models.deepseek_v4.blocks import sinkhorn
from kernels.sinkhorn import sinkhorn_reference, sinkhorn_triton

# CUDA runs the compiled kernels; elsewhere Triton's interpreter runs them (tests/__init__.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("hc,tokens", [(4, 1), (4, 70), (2, 5), (3, 130)])
def test_sinkhorn_kernel_matches_the_reference(hc: int, tokens: int) -> None:
    g = torch.Generator().manual_seed(hc * tokens)
    logits = 3 * torch.randn(hc, hc, tokens, generator=g)
    got = sinkhorn_triton(logits.to(DEVICE), 20, 1e-6).cpu()
    want = sinkhorn_reference(logits, 20, 1e-6)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    model = sinkhorn(torch.softmax(logits, dim=1), 20, 1e-6)
    torch.testing.assert_close(got, model, atol=1e-6, rtol=1e-5)
    # doubly stochastic up to eps: columns sum to ~1 after the last round
    torch.testing.assert_close(got.sum(0), torch.ones(hc, tokens), atol=1e-4, rtol=0)
