"""KV manager: per-request block tables over one pool per KV group, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.kv.block_pool import BlockPool
from daemon.kv.spec import KVGroup


@dataclass
class KVUsage:
    num_blocks: int
    num_free: int

    @property
    def used_fraction(self) -> float:
        return 1.0 - self.num_free / self.num_blocks


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

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        missing = self._missing(request_id, num_tokens)
        return all(m <= p.num_free for m, p in zip(missing, self.pools))

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

    def free(self, request_id: str) -> None:
        tables = self.tables.pop(request_id, None)
        if tables is None:
            return
        for table, pool in zip(tables, self.pools):
            for block in reversed(table):
                pool.decref(block)
