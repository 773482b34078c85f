"""Host-memory tier of the prefix cache: block payloads (every paged group of one prefix block,
as bytes) keyed by prefix key, LRU within a byte budget."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class HostBlock:
    """One prefix block's KV bytes; `payload` is None until the device worker has copied it."""

    nbytes: int
    payload: torch.Tensor | None = None  # uint8 [nbytes], CPU


class HostTier:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, HostBlock] = OrderedDict()
        self.bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def reserve(self, key: bytes, nbytes: int) -> HostBlock | None:
        """An entry for `key` to be filled later; None when the budget cannot hold one block."""
        if nbytes > self.max_bytes:
            return None
        self.discard(key)
        while self.bytes + nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        entry = HostBlock(nbytes)
        self.entries[key] = entry
        self.bytes += nbytes
        return entry

    def put(self, key: bytes, payload: torch.Tensor) -> HostBlock | None:
        entry = self.reserve(key, payload.numel())
        if entry is not None:
            entry.payload = payload
        return entry

    def get(self, key: bytes) -> HostBlock | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def discard(self, key: bytes) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
