"""Stored Responses (OpenAI's `store: true`) in host memory: least recently used out past a count
and a byte budget, and dropped `ttl_s` after their last use."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StoredResponse:
    response: bytes  # the response object as it was answered (JSON)
    input_items: bytes  # JSON list: the conversation it was generated from, earlier turns included
    expires: float  # monotonic time

    @property
    def nbytes(self) -> int:
        return len(self.response) + len(self.input_items)


class ResponseStore:
    """Keyed by response id. A `get` is a use: it renews the TTL and the LRU place, so the least
    recently used entry is also the first to expire."""

    def __init__(
        self,
        max_count: int = 10_000,
        max_bytes: int = 512 << 20,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_count, self.max_bytes, self.ttl_s, self.clock = max_count, max_bytes, ttl_s, clock
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0 and self.ttl_s > 0

    def put(self, response_id: str, response: bytes, input_items: bytes) -> bool:
        """False when it cannot be kept (the store is off, or the entry alone is over budget)."""
        entry = StoredResponse(response, input_items, self.clock() + self.ttl_s)
        if not self.enabled or entry.nbytes > self.max_bytes:
            return False
        self.delete(response_id)
        self._drop_expired()
        while self.entries and (
            len(self.entries) >= self.max_count or self.bytes + entry.nbytes > self.max_bytes
        ):
            self._pop(next(iter(self.entries)))
        self.entries[response_id] = entry
        self.bytes += entry.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._drop_expired()
        entry = self.entries.get(response_id)
        if entry is None:
            return None
        entry.expires = self.clock() + self.ttl_s
        self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        if response_id not in self.entries:
            return False
        self._pop(response_id)
        return True

    def __len__(self) -> int:
        return len(self.entries)

    def _drop_expired(self) -> None:
        now = self.clock()
        while self.entries:
            response_id, entry = next(iter(self.entries.items()))
            if entry.expires > now:
                return
            self._pop(response_id)

    def _pop(self, response_id: str) -> None:
        self.bytes -= self.entries.pop(response_id).nbytes
