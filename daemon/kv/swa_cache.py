"""Short-lived sliding-window state (host memory): a sequence's SWA KV at a block boundary,
keyed by the prefix key there, with a TTL and a byte budget (LRU)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
        self.bytes = self.peak_bytes = 0
        self.hits = self.misses = 0
        self.saves = self.evictions = 0

    def reserve(self, key: bytes, position: int, nbytes: int) -> SWASnapshot | None:
        """A slot for the snapshot of prefix `key`; None when it cannot fit."""
        if nbytes > self.max_bytes:
            return None
        self.discard(key)
        self.sweep()
        while self.bytes + nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        snap = SWASnapshot(position, nbytes, expires=time.monotonic() + self.ttl_s)
        self.entries[key] = snap
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.saves += 1
        return snap

    def get(self, key: bytes) -> SWASnapshot | None:
        """The snapshot at `key`, counted as a lookup (hit or miss)."""
        snap = self.peek(key)
        if snap is None:
            self.misses += 1
        else:
            self.hits += 1
        return snap

    def peek(self, key: bytes) -> SWASnapshot | None:
        """The live snapshot at `key`, uncounted; a use: it becomes the most recent and its TTL
        starts again (retention counts from the last use, as the block store's)."""
        snap = self.entries.get(key)
        if snap is None:
            return None
        now = time.monotonic()
        if snap.expires < now:
            self.discard(key)
            return None
        snap.expires = now + self.ttl_s
        self.entries.move_to_end(key)
        return snap

    def sweep(self) -> None:
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

    def stats(self) -> dict[str, float]:
        self.sweep()
        lookups = self.hits + self.misses
        return {
            "swa_hits": self.hits,
            "swa_misses": self.misses,
            "swa_hit_rate": self.hits / lookups if lookups else 0.0,
            "swa_cache_snapshots": len(self.entries),
            "swa_cache_bytes": self.bytes,
            "swa_cache_peak_bytes": self.peak_bytes,
            "swa_cache_saves": self.saves,
            "swa_cache_evictions": self.evictions,
        }
