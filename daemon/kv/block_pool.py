"""A pool of fixed-size KV blocks with reference counts and an LRU free list.

A freed block keeps its content: while it sits in the free list it can be taken
back (a prefix-cache hit). Allocation takes the least recently freed block first
and tells `on_reuse` (given at construction) so the prefix index forgets it.

Where a request's blocks lie matters on a CPU: a decode step's attention reads each
sequence's blocks in turn from memory, and a table that jumps costs up to +55 % over one
that runs forward (`bench.cpu_kernels scatter`). So an allocation continues a run where it
can: after the LRU's pick (or the request's last block) it takes the next block in memory
if that one is free and in the older half of the free list by the time it was freed, so a
block freed recently, whose content the prefix cache is likelier to be asked for, is not
taken out of turn; nor is any block with content while the LRU's head holds nothing (the
blocks never used head the free list). A block that holds nothing (never used, or a rejected
draft's, which stays at the LRU's tail for its request to grow back into) a run takes anyway.
One allocation's blocks go out ascending (a request frees its tail first, so they come back
descending); those continuing the request's last block first.
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
        self._clock = 0  # frees of blocks with content so far
        # the clock when each block was last freed; 0: it holds nothing of use
        self._freed_at = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks; `after`: the request's last block, which the first ones continue where
        they can (see the module)."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        head = self._freed_at[next(iter(self._free))] if self._free else 0
        old = head + (self._clock - head) // 2  # freed at or before: the older half
        blocks: list[int] = []
        continuing = 0  # how many of `blocks` continue `after`
        nxt = None if after is None else after + 1
        for _ in range(n):
            if nxt is not None and self._spare(nxt, old):
                block = nxt
                del self._free[block]
                if after is not None and len(blocks) == continuing:
                    continuing += 1
            else:
                block, _ = self._free.popitem(last=False)
            if self._on_reuse is not None:
                self._on_reuse(block)
            self.ref_counts[block] = 1
            blocks.append(block)
            nxt = block + 1
        # forward in memory, as the prefetchers read (see the module)
        return blocks[:continuing] + sorted(blocks[continuing:])

    def _spare(self, block: int, old: int) -> bool:
        if block >= self.num_blocks or self.ref_counts[block] != 0:
            return False
        if self._freed_at[block] == 0:
            return True  # holds nothing
        # content only where the LRU's head is content too (see the module)
        return self._freed_at[next(iter(self._free))] != 0 and self._freed_at[block] <= old

    def take(self, block: int) -> None:
        """Reference a block by id: a free one (cached content) leaves the free list."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free")
        self.ref_counts[block] += 1

    def decref(self, block: int, keeps_content: bool = True) -> None:
        """Drop a reference; the last one frees the block. `keeps_content=False`: what it holds
        is of no use to anyone (a rejected draft's KV): a request that grows again continues into
        it (see the module)."""
        count = self.ref_counts[block]
        if count <= 0:
            raise ValueError(f"block {block} freed twice")
        self.ref_counts[block] = count - 1
        if count == 1:
            self._free[block] = None
            if keeps_content:
                self._clock += 1
                self._freed_at[block] = self._clock
            else:
                self._freed_at[block] = 0
