"""Paged decode attention on CPU that reads K/V blocks in place (C++, csrc/paged_attention.cpp)
as the torch op `deepinfer::paged_decode_attention`, next to its torch reference (gather the
blocks, then SDPA with a mask)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import cpu_build

# DEEPINFER_CPU_KERNELS=0 keeps the torch reference on CPU too (read once, at import).
ENABLED = os.environ.get("DEEPINFER_CPU_KERNELS", "1") != "0"
DTYPES = (torch.float32, torch.bfloat16)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """q [B, Hq, D]; caches [slots, Hkv, D]; block_tables [B, blocks]; mask [B, 1, 1, blocks *
    block_size] (True = attend) -> [B, Hq, D]. Copies every row's blocks, then one SDPA."""
    b = q.shape[0]

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, blocks * block_size, D]
        paged = cache.view(-1, block_size, *cache.shape[1:])
        # index_select: on CPU several times faster than advanced indexing
        rows = paged.index_select(0, block_tables.flatten())
        return rows.view(b, -1, *cache.shape[1:]).transpose(1, 2)

    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        gather(k_cache),
        gather(v_cache),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[1],
    )
    return o.squeeze(2)


def context_mask(context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, 1, 1, width] True on the first context_lens[b] positions of row b."""
    pos = torch.arange(width, device=context_lens.device)
    return (pos[None, :] < context_lens[:, None]).view(-1, 1, 1, width)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the op serves these tensors (CPU, fp32 or bf16, a GQA ratio up to 16)."""
    return (
        ENABLED
        and q.device.type == "cpu"
        and q.dtype in DTYPES
        and k_cache.dtype == q.dtype
        and q.shape[1] % k_cache.shape[1] == 0
        and q.shape[1] // k_cache.shape[1] <= 16
        and cpu_build.available()  # False where it cannot be built
    )


def build() -> bool:
    """Compile (or load from the cache) the C++ kernel now, e.g. while the engine starts: the
    op has no CPU implementation before. False where it cannot be built."""
    return cpu_build.load()


# the C++ library registers the CPU kernel of this schema when it loads
torch.library.define(
    "deepinfer::paged_decode_attention",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
    "float scale, int block_size, int splits=0, bool generic=False) -> Tensor",
)


@torch.library.register_fake("deepinfer::paged_decode_attention")
def _(q, k_cache, v_cache, block_tables, context_lens, scale, block_size, splits=0, generic=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    *,
    splits: int = 0,
    generic: bool = False,
) -> torch.Tensor:
    """q [B, Hq, D]; caches [slots, Hkv, D] (contiguous); block_tables [B, blocks] (int64, rows
    padded with any block); context_lens [B] (int64, >= 1) -> [B, Hq, D], q's dtype. Row b
    attends the cache slots of its first context_lens[b] positions. `splits` cuts each context
    into that many pieces (0: chosen from the batch and the threads); `generic` forces the
    scalar kernel (for tests). Call `build` first where a torch.compile trace may come first."""
    if not torch.compiler.is_compiling():
        build()
    return torch.ops.deepinfer.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, block_size, splits, generic
    )
