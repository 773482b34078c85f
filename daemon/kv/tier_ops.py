"""The tier ops the device worker runs before a step's forward (CacheOps), and the queue that
gathers them (TierQueue)."""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.kv.host_tier import HostBlock, HostTier
from daemon.kv.swa_cache import SWASnapshot


@dataclass
class RestoreOp:
    """Before the request's first step: per-request state at `position` (snapshot None =
    only the block-boundary compressor state; the sliding window comes from a replay)."""

    position: int
    snapshot: SWASnapshot | None


@dataclass
class SWASave:
    snapshot: SWASnapshot
    swa_block: int
    position: int


@dataclass
class BlockSave:
    """Copy a prefix block (its block in every paged group) to host memory."""

    key: bytes
    blocks: list[int]
    entry: HostBlock
    persist_as: str | None  # traffic class to write it to the block store under


@dataclass
class BlockLoad:
    """Copy a host payload into freshly adopted device blocks."""

    blocks: list[int]
    entry: HostBlock
    tier: str  # where the payload came from: host or store


@dataclass
class CacheOps:
    """One run's ops, in the order the worker runs them: device->host copies (of computed
    blocks worth persisting, and of cached blocks about to be overwritten), host->device loads,
    then sliding-window saves; the step's restores (RestoreOp, with its sequences) follow."""

    block_saves: list[BlockSave] = field(default_factory=list)
    block_loads: list[BlockLoad] = field(default_factory=list)
    swa_saves: list[SWASave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.block_saves or self.block_loads or self.swa_saves)


class TierQueue:
    """The ops for the worker's next run. The prefix cache queues loads and saves; the KV
    manager's evictions queue demotions (`demote`, its `on_evict`), so the queue exists before
    either. Taken once per step (or idle round) by the engine."""

    def __init__(self, host: HostTier | None, block_bytes: int) -> None:
        self.host, self.block_bytes = host, block_bytes
        self.ops = CacheOps()
        self._loading: set[bytes] = set()  # keys with a load queued in ops

    def load(self, key: bytes, blocks: list[int], entry: HostBlock, tier: str) -> None:
        self.ops.block_loads.append(BlockLoad(blocks, entry, tier))
        self._loading.add(key)

    def save(self, key: bytes, blocks: list[int], persist_as: str | None) -> None:
        """Copy computed blocks to host memory (a reserved host entry, or a transient one)."""
        entry = self.host.reserve(key, self.block_bytes) if self.host is not None else None
        entry = entry or HostBlock(self.block_bytes)
        self.ops.block_saves.append(BlockSave(key, blocks, entry, persist_as))

    def save_swa(self, snapshot: SWASnapshot, swa_block: int, position: int) -> None:
        self.ops.swa_saves.append(SWASave(snapshot, swa_block, position))

    def demote(self, key: bytes, blocks: list[int]) -> None:
        """A cached device block is about to be reused: copy it to host memory first."""
        if self.host is None or key in self.host or key in self._loading:
            return  # (a block adopted this round holds nothing yet)
        entry = self.host.reserve(key, self.block_bytes)
        if entry is not None:
            self.ops.block_saves.append(BlockSave(key, blocks, entry, None))

    def take(self) -> CacheOps:
        ops, self.ops = self.ops, CacheOps()
        self._loading.clear()
        return ops
