"""KV manager: per-request block tables over one pool per KV group, sized from a memory budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from daemon.kv.block_pool import BlockPool
from daemon.kv.kinds import KindManager, SlidingWindowManager, manager_for
from daemon.kv.spec import KVGroup

# told (key, blocks) when a cached device block is about to be overwritten (to demote it)
EvictionListener = Callable[[bytes, list[int]], None]


class KVBudgetTooSmall(ValueError):
    pass


@dataclass
class KVUsage:
    num_blocks: int
    num_free: int


def pool_sizes(groups: list[KVGroup], memory_bytes: int, max_num_seqs: int = 1) -> list[int]:
    """Blocks of each group's pool within `memory_bytes` (see `_pool_sizes`)."""
    return _pool_sizes([manager_for(g.spec) for g in groups], memory_bytes, max_num_seqs)


def _pool_sizes(kinds: list[KindManager], memory_bytes: int, max_num_seqs: int) -> list[int]:
    """Blocks of each kind's pool within `memory_bytes`. Per-request state gets one block per
    possible running request; what is left goes to paged groups, each with blocks for the same
    number of token positions, so the rest is split in proportion to their bytes per token."""
    if not kinds:
        raise ValueError("a model needs at least one KV group")
    budget = memory_bytes
    fixed = [k.spec for k in kinds if k.spec.per_request]
    paged = [k.spec for k in kinds if not k.spec.per_request]
    memory_bytes -= sum(s.bytes_per_block * max_num_seqs for s in fixed)
    bytes_per_token = sum(s.bytes_per_block / s.block_size for s in paged)
    capacity_tokens = int(max(memory_bytes, 0) // bytes_per_token) if paged else 0
    block_tokens = max((s.block_size for s in paged), default=0)
    if capacity_tokens < block_tokens:
        raise KVBudgetTooSmall(
            f"{budget / 2**20:.1f} MiB of KV memory hold no block: the state of "
            f"{max_num_seqs} running requests takes {(budget - memory_bytes) / 2**20:.1f} MiB, "
            f"then a block of every paged group {block_tokens * bytes_per_token / 2**20:.2f} "
            "MiB; raise kv_cache_memory_gb or lower max_num_seqs"
        )
    return [k.pool_blocks(capacity_tokens, max_num_seqs) for k in kinds]


class KVManager:
    def __init__(
        self,
        groups: list[KVGroup],
        memory_bytes: int,
        max_num_seqs: int = 1,
        on_evict: EvictionListener | None = None,
    ) -> None:
        """`on_evict`: the prefix cache's demotion, told before a cached block is reused."""
        self.groups = groups
        self.kinds: list[KindManager] = [manager_for(g.spec) for g in groups]
        sizes = _pool_sizes(self.kinds, memory_bytes, max_num_seqs)
        self.tables: dict[str, list[list[int]]] = {}
        # prefix cache: key of a full block -> its block in every paged group
        self.paged = [i for i, g in enumerate(groups) if not g.spec.per_request]
        self.prefix_block = groups[self.paged[0]].spec.block_size if self.paged else 0
        # the sliding-window group the prefix cache snapshots, if the model has one
        self.swa_group = next(
            (i for i, k in enumerate(self.kinds) if isinstance(k, SlidingWindowManager)), None
        )
        self.cached: dict[bytes, list[int]] = {}
        self._key_of: list[dict[int, bytes]] = [{} for _ in groups]
        self._on_evict = on_evict
        self.pools = [
            BlockPool(n, (lambda block, i=i: self._forget(i, block)) if i in self.paged else None)
            for i, n in enumerate(sizes)
        ]

    @property
    def num_blocks(self) -> list[int]:
        return [p.num_blocks for p in self.pools]

    def usage(self) -> list[KVUsage]:
        return [KVUsage(p.num_blocks, p.num_free) for p in self.pools]

    def capacity_tokens(self) -> int:
        return min(self.pools[i].num_blocks * self.groups[i].spec.block_size for i in self.paged)

    def bytes_per_token(self) -> float:
        """Long-term KV bytes one token of context costs (paged groups only)."""
        return sum(
            self.groups[i].spec.bytes_per_block / self.groups[i].spec.block_size for i in self.paged
        )

    def bytes_per_request(self) -> int:
        """Fixed state bytes each running request holds whatever its length."""
        return sum(g.spec.bytes_per_block for g in self.groups if g.spec.per_request)

    def block_tables(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]

    def _missing(self, request_id: str, num_tokens: int) -> list[int]:
        held = self.tables.get(request_id)
        return [
            k.blocks_for(num_tokens) - (len(held[i]) if held else 0)
            for i, k in enumerate(self.kinds)
        ]

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's tables cover `num_tokens` positions; False if memory is short."""
        missing = self._missing(request_id, num_tokens)
        if any(m > p.num_free for m, p in zip(missing, self.pools)):
            return False
        tables = self.tables.setdefault(request_id, [[] for _ in self.groups])
        for table, pool, m in zip(tables, self.pools, missing):
            if m > 0:
                table.extend(pool.allocate(m, table[-1] if table else None))
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
        blocks = [
            self.pools[i].allocate(1, tables[i][-1] if tables[i] else None)[0] for i in self.paged
        ]
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
        if self._on_evict is not None:
            self._on_evict(key, blocks)

    def swa_block(self, request_id: str) -> int:
        """The request's sliding-window ring block (the model has a sliding-window group)."""
        assert self.swa_group is not None
        kind = self.kinds[self.swa_group]
        assert isinstance(kind, SlidingWindowManager)
        return kind.snapshot_block(self.tables[request_id][self.swa_group])

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's trailing blocks past its first `num_tokens` positions (those
        grown for draft tokens that were rejected): it then holds what a request of that
        length holds."""
        tables = self.tables.get(request_id)
        if tables is None:
            return
        for table, kind, pool in zip(tables, self.kinds, self.pools):
            keep = kind.blocks_for(num_tokens)
            while len(table) > keep:
                pool.decref(table.pop(), keeps_content=False)

    def free(self, request_id: str) -> None:
        tables = self.tables.pop(request_id, None)
        if tables is None:
            return
        for table, pool in zip(tables, self.pools):
            for block in reversed(table):
                pool.decref(block)
