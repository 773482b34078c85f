"""A pool of fixed-size KV blocks with reference counts and a free list."""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block; raise the memory budget")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

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
            self._free.append(block)
