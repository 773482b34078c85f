"""Host tensors in transparent huge pages: a CPU KV cache read block by block from scattered
places walks page tables in 4 KiB pages (a decode step's attention 3-6 % slower from memory,
`bench.cpu_kernels scatter`)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own anonymous mapping, 2 MiB-aligned and advised
    MADV_HUGEPAGE before its first touch (the kernel's THP mode `madvise`, a common default,
    gives huge pages only to advised memory); plain `torch.zeros` where the platform has no
    such advice. The mapping lives as long as the tensor."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(region)
    offset = -ctypes.addressof(anchor) % HUGE_PAGE
    del anchor  # a live export would pin the mapping's buffer for good
    with contextlib.suppress(OSError):  # THP compiled out: ordinary pages, still zeroed
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    # the tensor holds the view, the view the mapping
    out = torch.frombuffer(memoryview(region)[offset : offset + nbytes], dtype=dtype)
    out = out.view(shape)
    out.zero_()  # fault every page in now (a fresh mapping reads as zeros already)
    return out
