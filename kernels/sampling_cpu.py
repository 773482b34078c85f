"""Top-k / top-p / min-p sampling of one token per row on CPU (C++, csrc/sampling.cpp) as the
torch op `deepinfer::sample_rows`, next to its torch reference (a full sort, then the inverse
CDF at the same uniform draws). Both draw from weights e^(x - max x), x = logits / temperature.
Greedy rows: `deepinfer::greedy_rows` (csrc/greedy.cpp; reference: torch's `max`)."""

from __future__ import annotations

import os

import torch

from kernels import cpu_build

# DEEPINFER_CPU_KERNELS=0 keeps the torch sampler on CPU too (read once, at import).
ENABLED = os.environ.get("DEEPINFER_CPU_KERNELS", "1") != "0"


def row_weights(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[S, V] e^(x - max x) of x = logits / temperature[:, None]: each row's largest is 1."""
    x = logits / temperature[:, None]
    return x.sub_(x.max(dim=-1, keepdim=True).values).exp_()


def sample_rows_reference(
    weights: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """weights [S, V] (row max 1); top_k [S] (V = off); top_p, min_p, u [S] -> [S] tokens.
    Keeps each row's top_k most likely, drops a token once the mass strictly before it (in
    the whole row's distribution) reaches top_p, then those under min_p; returns the first
    kept token, in id order, at which the kept mass passes u * the kept total."""
    w, order = weights.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(w.shape[-1])
    drop = rank[None, :] >= top_k[:, None]
    probs = w / weights.sum(-1, keepdim=True)
    drop |= probs.cumsum(-1) - probs >= top_p[:, None]
    drop[:, 0] = False
    keep = torch.empty_like(drop).scatter_(1, order, ~drop)
    keep &= weights >= min_p[:, None]
    kept = weights.double().masked_fill(~keep, 0.0)
    cum = kept.cumsum(-1)
    pos = (cum <= u.double()[:, None] * cum[:, -1:]).sum(-1)
    # past the last kept token only by rounding: take the last kept one
    last = kept.shape[-1] - 1 - keep.flip(-1).int().argmax(-1)
    return torch.minimum(pos, last)


torch.library.define(
    "deepinfer::sample_rows",
    "(Tensor weights, Tensor totals, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u) -> Tensor",
)


@torch.library.register_fake("deepinfer::sample_rows")
def _(weights, totals, top_k, top_p, min_p, u):
    return weights.new_empty(weights.shape[0], dtype=torch.long)


def supports(logits: torch.Tensor) -> bool:
    """Whether the op serves these logits (float32 on a CPU, the library built)."""
    return (
        ENABLED
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and cpu_build.available()
    )


torch.library.define("deepinfer::greedy_rows", "(Tensor logits) -> Tensor")


@torch.library.register_fake("deepinfer::greedy_rows")
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def supports_greedy(logits: torch.Tensor) -> bool:
    """Whether `greedy_rows` serves these logits ([S, V] float32 or bfloat16 on a CPU)."""
    return (
        ENABLED
        and logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and cpu_build.available()
    )


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S] each row's argmax, the first of tied maxima, as `logits.max(-1).indices` (NaNs
    are passed over): one pass, no reduction tensors (`bench.cpu_kernels sampling`)."""
    cpu_build.load()
    return torch.ops.deepinfer.greedy_rows(logits)


def sample_rows(
    weights: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """As `sample_rows_reference`, float32 weights on CPU, sorting only as far as the cuts."""
    cpu_build.load()
    totals = weights.sum(-1)  # torch's sum, as the reference's (the top-p cut at a tie)
    return torch.ops.deepinfer.sample_rows(weights, totals, top_k, top_p, min_p, u)
