"""KV manager: per-request block tables over one pool per KV group, sized from a memory budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from daemon.kv.block_pool import BlockPool
from daemon.kv.spec import KVGroup


class KVBudgetTooSmall(ValueError):
    pass


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
        budget = memory_bytes
        fixed = [g for g in groups if g.spec.per_request]
        paged = [g for g in groups if not g.spec.per_request]
        memory_bytes -= sum(g.spec.bytes_per_block * max_num_seqs for g in fixed)
        bytes_per_token = sum(g.spec.bytes_per_block / g.spec.block_size for g in paged)
        capacity_tokens = int(max(memory_bytes, 0) // bytes_per_token) if paged else 0
        block_tokens = max((g.spec.block_size for g in paged), default=0)
        if capacity_tokens < block_tokens:
            raise KVBudgetTooSmall(
                f"{budget / 2**20:.1f} MiB of KV memory hold no block: the state of "
                f"{max_num_seqs} running requests takes {(budget - memory_bytes) / 2**20:.1f} MiB, "
                f"then a block of every paged group {block_tokens * bytes_per_token / 2**20:.2f} "
                "MiB; raise kv_cache_memory_gb or lower max_num_seqs"
            )
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
        # told (key, blocks) when a cached block is about to be overwritten, so it can be demoted
        self.on_evict: Callable[[bytes, list[int]], None] | None = None
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

    def take_cached(self, request_id: str, key: bytes) -> None:
        """Append the cached blocks of `key` to the request's paged tables."""
        tables = self.tables.setdefault(request_id, [[] for _ in self.groups])
        for i, block in zip(self.paged, self.cached[key]):
            self.pools[i].take(block)
            tables[i].append(block)

    def adopt(self, request_id: str, key: bytes) -> list[int] | None:
        """Append fresh blocks that will hold `key`'s KV (loaded from another tier) and make
        them findable; None when a paged pool has no block to give."""
        if any(self.pools[i].num_free == 0 for i in self.paged) or key in self.cached:
            return None
        tables = self.tables.setdefault(request_id, [[] for _ in self.groups])
        blocks = [self.pools[i].allocate(1)[0] for i in self.paged]
        for i, block in zip(self.paged, blocks):
            tables[i].append(block)
            self._key_of[i][block] = key
        self.cached[key] = blocks
        return blocks

    def register(self, request_id: str, index: int, key: bytes) -> list[int] | None:
        """Block `index` of the request is full and computed: make it findable by `key`.
        Returns its blocks, or None if the key was cached already."""
        if key in self.cached:
            return None
        tables = self.tables[request_id]
        blocks = [tables[i][index] for i in self.paged]
        if any(block in self._key_of[i] for i, block in zip(self.paged, blocks)):
            return None  # the block already stands for another prefix (taken from the cache)
        self.cached[key] = blocks
        for i, block in zip(self.paged, blocks):
            self._key_of[i][block] = key
        return blocks

    def _forget(self, group: int, block: int) -> None:
        key = self._key_of[group].pop(block, None)
        if key is None:
            return
        blocks = self.cached.pop(key)
        for i, other in zip(self.paged, blocks):
            self._key_of[i].pop(other, None)
        if self.on_evict is not None:
            self.on_evict(key, blocks)

    def free(self, request_id: str) -> None:
        tables = self.tables.pop(request_id, None)
        if tables is None:
            return
        for table, pool in zip(tables, self.pools):
            for block in reversed(table):
                pool.decref(block)
