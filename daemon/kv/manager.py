"""KV manager: per-request block tables over one pool per KV group, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.kv.block_pool import BlockPool
from daemon.kv.spec import KVGroup


@dataclass
class KVUsage:
    num_blocks: int
    num_free: int


class KVManager:
    def __init__(self, groups: list[KVGroup], memory_bytes: int, max_num_seqs: int = 1) -> None:
        if not groups:
            raise ValueError("a model needs at least one KV group")
        self.groups = groups
        # Per-request state gets one block per possible running request; what is
        # left goes to paged groups, each with blocks for the same number of token
        # positions, so the rest is split in proportion to their bytes per token.
        fixed = [g for g in groups if g.spec.per_request]
        paged = [g for g in groups if not g.spec.per_request]
        memory_bytes -= sum(g.spec.bytes_per_block * max_num_seqs for g in fixed)
        bytes_per_token = sum(g.spec.bytes_per_block / g.spec.block_size for g in paged)
        capacity_tokens = int(max(memory_bytes, 0) // bytes_per_token) if paged else 0
        self.pools = [
            BlockPool(max_num_seqs if g.spec.per_request else capacity_tokens // g.spec.block_size)
            for g in groups
        ]
        self.tables: dict[str, list[list[int]]] = {}
        # prefix cache: key of a full block -> its block in every paged group
        self.paged = [i for i, g in enumerate(groups) if not g.spec.per_request]
        self.prefix_block = groups[self.paged[0]].spec.block_size if self.paged else 0
        self.cached: dict[bytes, list[int]] = {}
        self._key_of: list[dict[int, bytes]] = [{} for _ in groups]
        for i in self.paged:
            self.pools[i].on_reuse = lambda block, i=i: self._forget(i, block)

    @property
    def num_blocks(self) -> list[int]:
        return [p.num_blocks for p in self.pools]

    def usage(self) -> list[KVUsage]:
        return [KVUsage(p.num_blocks, p.num_free) for p in self.pools]

    def capacity_tokens(self) -> int:
        paged = [(p, g) for p, g in zip(self.pools, self.groups) if not g.spec.per_request]
        return min(p.num_blocks * g.spec.block_size for p, g in paged)

    def bytes_per_token(self) -> float:
        """Long-term KV bytes one token of context costs (paged groups only)."""
        return sum(
            g.spec.bytes_per_block / g.spec.block_size
            for g in self.groups
            if not g.spec.per_request
        )

    def bytes_per_request(self) -> int:
        """Fixed state bytes each running request holds whatever its length."""
        return sum(g.spec.bytes_per_block for g in self.groups if g.spec.per_request)

    def block_tables(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]

    def _missing(self, request_id: str, num_tokens: int) -> list[int]:
        held = self.tables.get(request_id)
        return [
            g.spec.blocks_for(num_tokens) - (len(held[i]) if held else 0)
            for i, g in enumerate(self.groups)
        ]

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's tables cover `num_tokens` positions; False if memory is short."""
        missing = self._missing(request_id, num_tokens)
        if any(m > p.num_free for m, p in zip(missing, self.pools)):
            return False
        tables = self.tables.setdefault(request_id, [[] for _ in self.groups])
        for table, pool, m in zip(tables, self.pools, missing):
            if m > 0:
                table.extend(pool.allocate(m))
        return True

    # ---- prefix cache ---------------------------------------------------------------------

    def cached_prefix(self, keys: list[bytes]) -> int:
        """How many leading blocks of a chain of keys are cached."""
        n = 0
        while n < len(keys) and keys[n] in self.cached:
            n += 1
        return n

    def take_prefix(self, request_id: str, keys: list[bytes]) -> None:
        """Start the request's tables with the cached blocks of `keys` (all must be cached)."""
        tables = self.tables.setdefault(request_id, [[] for _ in self.groups])
        assert all(not tables[i] for i in self.paged), "a prefix goes in front of an empty table"
        for key in keys:
            for i, block in zip(self.paged, self.cached[key]):
                self.pools[i].take(block)
                tables[i].append(block)

    def register(self, request_id: str, index: int, key: bytes) -> None:
        """Block `index` of the request is full and computed: make it findable by `key`."""
        if key in self.cached:
            return
        tables = self.tables[request_id]
        blocks = [tables[i][index] for i in self.paged]
        if any(block in self._key_of[i] for i, block in zip(self.paged, blocks)):
            return  # the block already stands for another prefix (it was taken from the cache)
        self.cached[key] = blocks
        for i, block in zip(self.paged, blocks):
            self._key_of[i][block] = key

    def _forget(self, group: int, block: int) -> None:
        key = self._key_of[group].pop(block, None)
        if key is None:
            return
        for i, other in zip(self.paged, self.cached.pop(key)):
            self._key_of[i].pop(other, None)

    def free(self, request_id: str) -> None:
        tables = self.tables.pop(request_id, None)
        if tables is None:
            return
        for table, pool in zip(tables, self.pools):
            for block in reversed(table):
                pool.decref(block)
