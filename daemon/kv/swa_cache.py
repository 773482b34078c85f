"""Short-lived sliding-window state (host memory): a conversation's SWA KV at its last
block boundary, keyed by the prefix key there, with a TTL and a byte budget (LRU)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class SWASnapshot:
    """Filled by the device worker when the save op runs; read by a later restore op."""

    position: int
    nbytes: int
    tensor: torch.Tensor | None = None
    expires: float = field(default=0.0)


class SWACache:
    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self.entries: OrderedDict[bytes, SWASnapshot] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def reserve(self, key: bytes, position: int, nbytes: int) -> SWASnapshot | None:
        """A slot for the snapshot of prefix `key`; None when it cannot fit."""
        if nbytes > self.max_bytes:
            return None
        self.discard(key)
        self._drop_expired()
        while self.bytes + nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        snap = SWASnapshot(position, nbytes, expires=time.monotonic() + self.ttl_s)
        self.entries[key] = snap
        self.bytes += nbytes
        return snap

    def get(self, key: bytes) -> SWASnapshot | None:
        snap = self.entries.get(key)
        if snap is not None and snap.expires < time.monotonic():
            self.discard(key)
            snap = None
        if snap is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return snap

    def _drop_expired(self) -> None:
        """Expired snapshots at the old end go, so memory follows the TTL, not the budget."""
        now = time.monotonic()
        while self.entries:
            key, snap = next(iter(self.entries.items()))
            if snap.expires >= now:
                return
            self.discard(key)

    def discard(self, key: bytes) -> None:
        snap = self.entries.pop(key, None)
        if snap is not None:
            self.bytes -= snap.nbytes
