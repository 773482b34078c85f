"""The CPU KV cache's huge-page tensors: zeroed, aligned, advised, and alive as long as used."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from daemon.kv.spec import FullAttentionSpec
from daemon.models import huge_pages
from daemon.models.attention import PagedKVCache

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError("no mapping holds the address")


@linux
def test_a_large_tensor_is_zeroed_aligned_and_advised_for_huge_pages() -> None:
    t = huge_pages.zeros((3 << 20, 3), torch.bfloat16)
    assert t.shape == (3 << 20, 3) and t.dtype == torch.bfloat16
    assert t.is_contiguous() and not t.any()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE


@linux
def test_the_mapping_outlives_the_call_and_frees_with_the_tensor() -> None:
    t = huge_pages.zeros((1 << 20, 4), torch.float32)
    gc.collect()
    t[123] = 7.0
    t.view(-1)[-1] = 3.0
    assert t[123].tolist() == [7.0] * 4 and t.view(-1)[-1].item() == 3.0
    address = t.data_ptr()
    del t
    gc.collect()
    with pytest.raises(AssertionError, match="no mapping"):
        _vm_flags(address)


def test_a_small_tensor_is_an_ordinary_one() -> None:
    t = huge_pages.zeros((16, 8), torch.float32)
    assert t.shape == (16, 8) and not t.any()


@linux
def test_the_cpu_kv_cache_lives_in_huge_pages() -> None:
    spec = FullAttentionSpec(16, 2, torch.bfloat16, 4, 64)
    cache = PagedKVCache(spec, 1024, torch.device("cpu"))
    for k, v in cache.layers:
        for t in (k, v):
            assert t.shape == (1025 * 16, 4, 64) and not t.any()
            assert "hg" in _vm_flags(t.data_ptr())
