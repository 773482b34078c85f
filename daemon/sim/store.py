"""The simulated block store: which prefix keys it holds (LRU within a byte capacity, shared by
every simulated node, as one 3FS is) and what reads and writes moved. It stands where
kv/block_store.py BlockStore stands for PrefixCache (`submit_write`, `submit_touch`,
`counters`): a cluster's terabytes as files are what a simulator cannot write; their cost is
the cost table's store bandwidth."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from daemon.kv.block_store import StoreCounters


class SimStore:
    def __init__(self, capacity_bytes: float, block_bytes: int) -> None:
        """`capacity_bytes`: float('inf') for an unlimited store."""
        self.capacity_blocks = capacity_bytes // block_bytes if capacity_bytes else 0
        self.block_bytes = block_bytes
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.counters = StoreCounters()
        self.dir = Path("<simulated>")  # what the engine's logs name

    def __contains__(self, key: bytes) -> bool:
        return key in self.keys

    def submit_write(self, key: bytes, payload: torch.Tensor, traffic_class: str) -> None:
        if key in self.keys:
            self.counters.already_stored += 1
            self.keys.move_to_end(key)
            return
        if self.capacity_blocks < 1:
            self.counters.dropped_writes += 1
            return
        while len(self.keys) >= self.capacity_blocks:
            self.keys.popitem(last=False)
        self.keys[key] = None
        self.counters.writes += 1
        self.counters.bytes_written += self.block_bytes

    def submit_touch(self, keys: list[bytes]) -> None:
        for key in keys:
            if key in self.keys:
                self.keys.move_to_end(key)

    def read_chain(self, keys: list[bytes]) -> int:
        """How many leading blocks of `keys` the store holds (each counted as read)."""
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            self.keys.move_to_end(keys[n])
            n += 1
        self.counters.lookups += min(n + 1, len(keys))
        self.counters.hits += n
        self.counters.bytes_read += n * self.block_bytes
        return n
