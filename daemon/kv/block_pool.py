"""A pool of fixed-size KV blocks with reference counts and an LRU free list.

A freed block keeps its content: while it sits in the free list it can be taken
back (a prefix-cache hit). Allocation takes the least recently freed block first
and tells `on_reuse` (given at construction) so the prefix index forgets it; one
allocation's blocks go out ascending (a request frees its tail first, so they come back
descending, and the CPU's paged attention reads a descending table ~30 % slower).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, on_reuse: Callable[[int], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block; raise the memory budget")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._on_reuse = on_reuse

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            if self._on_reuse is not None:
                self._on_reuse(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        blocks.sort()  # forward in memory, as the prefetchers read (see the module)
        return blocks

    def take(self, block: int) -> None:
        """Reference a block by id: a free one (cached content) leaves the free list."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free")
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        count = self.ref_counts[block]
        if count <= 0:
            raise ValueError(f"block {block} freed twice")
        self.ref_counts[block] = count - 1
        if count == 1:
            self._free[block] = None
