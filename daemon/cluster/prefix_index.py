"""Which prefill node has which prompt prefixes: the hash-chain block keys routed to each one,
in a bounded LRU per node."""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_keys_per_node: int = 65536) -> None:
        self.max_keys = max_keys_per_node
        self._keys: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, node_id: str, keys: list[bytes]) -> int:
        """How many leading blocks of `keys` the node has been sent. A chain key stands for its
        whole prefix, so the longest present key decides."""
        held = self._keys.get(node_id)
        if not held:
            return 0
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in held:
                return n
        return 0

    def add(self, node_id: str, keys: list[bytes]) -> None:
        held = self._keys.setdefault(node_id, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.max_keys:
            held.popitem(last=False)

    def forget(self, keep: set[str]) -> None:
        """Drops the nodes not in `keep` (gone from the peer set)."""
        for node_id in [n for n in self._keys if n not in keep]:
            del self._keys[node_id]

    def size(self, node_id: str) -> int:
        return len(self._keys.get(node_id, ()))
