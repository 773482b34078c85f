"""One manager per KV kind (as vLLM's single-type managers): how many blocks a request of
that kind holds and how big its pool is; KVManager composes one per group."""

from __future__ import annotations

import math

from daemon.kv.spec import KVSpec, PagedSpec, PerRequestSpec, SlidingWindowSpec


class PagedManager:
    """Paged kinds (full attention, compressed KV): a block per `block_size` positions, the
    pool split from what per-request state leaves; full blocks are shared by the prefix cache."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a request holds once its sequence is `num_tokens` long."""
        return math.ceil(num_tokens / self.spec.block_size)

    def pool_blocks(self, capacity_tokens: int, max_num_seqs: int) -> int:
        return capacity_tokens // self.spec.block_size


class PerRequestManager:
    """Per-request state (compressor buffers): one block per running request, any length."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec

    def blocks_for(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    def pool_blocks(self, capacity_tokens: int, max_num_seqs: int) -> int:
        return max_num_seqs


class SlidingWindowManager(PerRequestManager):
    """A per-request sliding-window ring: what the prefix cache snapshots at block boundaries,
    since shared prefix blocks do not hold it."""

    def snapshot_block(self, table: list[int]) -> int:
        """The ring block of a request's table for this group (the one a snapshot copies)."""
        return table[0]


KindManager = PagedManager | PerRequestManager

# most specific spec class first: the first match in a spec's MRO wins
_MANAGERS: dict[type[KVSpec], type[KindManager]] = {
    SlidingWindowSpec: SlidingWindowManager,
    PerRequestSpec: PerRequestManager,
    PagedSpec: PagedManager,
}


def manager_for(spec: KVSpec) -> KindManager:
    for cls in type(spec).__mro__:
        manager = _MANAGERS.get(cls)
        if manager is not None:
            return manager(spec)
    raise TypeError(f"no KV manager for spec kind {type(spec).__name__}")
