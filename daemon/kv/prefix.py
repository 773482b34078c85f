"""Prefix reuse on admission, across tiers: the longest block-aligned prefix whose blocks sit
on the device, in host memory or (fetched before admission) in the block store; and for
models with sliding-window state (DeepSeek-V4) that state too.

Sliding-window snapshots are taken at each prompt's last full block (what a repeat, or a
request sharing those blocks, resumes from), where a request leaves (the next turn), and at
a boundary where a lookup missed (a prefix found shared: later requests hit there). On an
SWA-state miss the policy decides:
  replay  recompute the last layers x (W-1) tokens before the boundary, their window limited
          to the replayed range: each layer's window reaches W-1 tokens further back, so the
          state it leaves is exact, at a cost that does not grow with the context
  window  the seed's bounded replay: recompute only the last W tokens, their window limited to
          them (constant and smallest cost; the state, and the snapshots taken after it, are
          approximate)
  exact   resume from the last boundary whose SWA state is stored, or from scratch

Blocks move between tiers as ops the device worker runs before the step's forward, in
order: device->host copies (of computed blocks worth persisting, and of cached blocks about
to be overwritten), host->device loads, then sliding-window saves and restores.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from daemon.kv.block_store import BlockStore
from daemon.kv.host_tier import HostBlock, HostTier
from daemon.kv.manager import KVManager
from daemon.kv.prefix_hash import block_hashes
from daemon.kv.swa_cache import SWACache, SWASnapshot
from daemon.kv.swa_policy import POLICIES
from daemon.kv.tier_stats import CacheStats
from daemon.kv.traffic import TrafficClasses
from daemon.loop.request import Request

MAX_PROBES = 3  # store re-reads for one request whose in-memory prefix was evicted meanwhile
TOUCH_EVERY_S = 3600.0  # refresh a device/host hit's store file at most this often
_MAX_TOUCHED = 1 << 16


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
    block_saves: list[BlockSave] = field(default_factory=list)
    block_loads: list[BlockLoad] = field(default_factory=list)
    swa_saves: list[SWASave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.block_saves or self.block_loads or self.swa_saves)


class PrefixCache:
    def __init__(
        self,
        kv: KVManager,
        salt: bytes,
        *,
        block_bytes: int = 0,
        host: HostTier | None = None,
        store: BlockStore | None = None,
        classes: TrafficClasses | None = None,
        swa: SWACache | None = None,
        swa_group: int = -1,
        swa_bytes: int = 0,
        replay_tokens: int = 0,
        policy: str = "replay",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown SWA-miss policy {policy!r}; use one of {POLICIES}")
        self.kv, self.salt = kv, salt
        self.block = kv.prefix_block
        self.block_bytes, self.host, self.store = block_bytes, host, store
        self.classes = classes or TrafficClasses()
        self.swa, self.swa_group, self.swa_bytes = swa, swa_group, swa_bytes
        self.replay_tokens, self.policy = replay_tokens, policy
        self.ops = CacheOps()
        self._loading: set[bytes] = set()  # keys with a load queued in ops
        self._touched: OrderedDict[bytes, float] = OrderedDict()
        self.stats = CacheStats()
        kv.on_evict = self._demote

    def keys(self, req: Request) -> list[bytes]:
        tokens = req.prompt_ids + req.output_ids
        req.block_keys = block_hashes(
            tokens, self.block, self.salt + req.cache_salt, req.block_keys
        )
        return req.block_keys

    def _usable_keys(self, req: Request) -> list[bytes]:
        if req.params.prompt_logprobs is not None:
            return []  # each prompt position's logits are needed: no cached prefix (as vLLM)
        return self.keys(req)[: (req.num_known_tokens - 1) // self.block]  # a token to compute

    def _in_memory(self, key: bytes) -> bool:
        return key in self.kv.cached or (self.host is not None and key in self.host)

    def _leading(self, req: Request, keys: list[bytes]) -> int:
        """How many leading keys some tier holds (memory, or read from the store for `req`)."""
        n = 0
        while n < len(keys) and (self._in_memory(keys[n]) or keys[n] in req.loaded):
            n += 1
        return n

    # ---- before admission: the block store ------------------------------------------------

    def store_keys(self, req: Request) -> list[bytes]:
        """The keys past the prefix held in memory, to look for in the block store."""
        if self.store is None:
            return []
        keys = self._usable_keys(req)
        n = self._leading(req, keys)
        req.store_checked = n  # the keys before were in memory at this point
        return keys[n:]

    def receive(self, req: Request, keys: list[bytes], payloads: list) -> None:
        """Blocks the store had for the request: held for its admission, and in host memory."""
        if not req.cache_lookups.get("store"):
            req.cache_lookups["store"] = len(payloads) + (1 if len(payloads) < len(keys) else 0)
        req.store_checked += len(payloads)
        for key, payload in zip(keys, payloads):
            req.loaded[key] = payload
            if self.host is not None:
                self.host.put(key, payload)

    # ---- admission --------------------------------------------------------------------------

    def admit(self, req: Request) -> list[bytes] | None:
        """Called before a request's first step (new, or recomputing after preemption).
        Returns keys to read from the block store first when blocks that were in memory when
        the request arrived have been evicted while it waited; None once it is admitted."""
        keys = self._usable_keys(req)
        n = self._leading(req, keys)
        if self.store is not None and n < req.store_checked and req.store_probes < MAX_PROBES:
            req.store_probes += 1
            req.store_checked = n
            return keys[n:]
        first_admission = req.num_preemptions == 0
        if first_admission:
            on_device = sum(1 for k in keys[:n] if k in self.kv.cached)
            missed = 1 if n < len(keys) else 0
            req.cache_lookups["device"] = n + missed
            req.cache_lookups["host"] = (n - on_device + missed) if self.host is not None else 0
        snapshot, missed_at = None, 0
        if self.swa is not None and n:
            snapshot = self.swa.get(keys[n - 1])
            if snapshot is None:
                missed_at = n * self.block  # snapshot it on the way: the next request hits
                if self.policy == "exact":
                    while n and snapshot is None:
                        n -= 1
                        snapshot = self.swa.peek(keys[n - 1]) if n else None
        planned = n
        hits = self._take(req, keys[:n])
        n = sum(hits.values())
        if n < planned and self.swa is not None:  # device blocks ran short
            if self.policy == "exact":  # the stored window is for `planned`: start over
                self.kv.free(req.request_id)
                hits, n = Counter(), 0
            snapshot = None
        if first_admission:
            req.cache_hits = dict(hits)
            left, req.cached_tokens_by_tier = req.num_prompt_tokens, {}
            for tier, blocks in hits.items():
                req.cached_tokens_by_tier[tier] = min(blocks * self.block, left)
                left -= req.cached_tokens_by_tier[tier]
        position = n * self.block
        if n:
            req.num_computed = req.num_cached_tokens = position
            req.num_registered = n
        if self.swa is not None:
            if n:
                req.pending_restore = RestoreOp(position, snapshot)
            if n and snapshot is None:  # replay the window's reach before the boundary
                req.replay_until = position
                req.replay_from = req.num_computed = position - min(self.replay_tokens, position)
                req.num_cached_tokens = req.num_computed
            req.swa_marks = self._marks(req, position, missed_at)
        return None

    def _marks(self, req: Request, resume: int, missed_at: int) -> list[int]:
        """Boundaries to snapshot the sliding window at, from `resume` (where a replay ends)
        on: the known tokens' last full block and the one before it (a repeat resumes there,
        as it keeps a token to compute) and the boundary whose lookup missed."""
        known = req.num_known_tokens
        ends = {known // self.block * self.block, (known - 1) // self.block * self.block}
        marks = ends | {missed_at}
        return sorted(m for m in marks if m > req.num_computed and m >= resume)

    def chunk_limit(self, req: Request, n: int) -> int:
        """At most `n` tokens for the request's next chunk, ending where the SWA ring still
        holds the window before its next snapshot boundary (one block past it)."""
        if not req.swa_marks:
            return n
        after = [m for m in req.swa_marks if m > req.num_computed]
        return min(n, after[0] + self.block - req.num_computed) if after else n

    def _take(self, req: Request, keys: list[bytes]) -> Counter[str]:
        """Put the blocks of `keys` at the head of the request's tables, loading those that are
        not on the device; stops early when the device has no block to load into."""
        hits: Counter[str] = Counter()
        resident = []  # hits from memory: uses the store does not see
        for key in keys:
            if key in self.kv.cached:
                self.kv.take_cached(req.request_id, key)
                hits["device"] += 1
                resident.append(key)
                continue
            if key in req.loaded:
                tier, entry = "store", HostBlock(self.block_bytes, req.loaded[key])
            else:
                tier, entry = "host", self.host.get(key) if self.host is not None else None
            blocks = self.kv.adopt(req.request_id, key) if entry is not None else None
            if blocks is None:
                break
            self.ops.block_loads.append(BlockLoad(blocks, entry, tier))
            self._loading.add(key)
            hits[tier] += 1
            if tier == "host":
                resident.append(key)
        self._touch(resident)
        return hits

    def _touch(self, keys: list[bytes]) -> None:
        """Device and host hits are uses too: keep their store files from expiring."""
        if self.store is None:
            return
        now = time.monotonic()
        due = [k for k in keys if now - self._touched.get(k, -TOUCH_EVERY_S) >= TOUCH_EVERY_S]
        for key in due:
            self._touched[key] = now
            self._touched.move_to_end(key)
        while len(self._touched) > _MAX_TOUCHED:
            self._touched.popitem(last=False)
        if due:
            self.store.submit_touch(due)

    # ---- while running ------------------------------------------------------------------------

    def register(self, req: Request) -> None:
        """Make the request's full, computed blocks findable, and persist them per its class;
        snapshot the sliding window at the boundaries it has reached."""
        if req.swa_marks:
            self._snapshot(req)
        full = min(req.num_computed, req.num_known_tokens) // self.block
        if full <= req.num_registered:
            return
        keys = self.keys(req)
        persist = self._persist_class(req)
        for i in range(req.num_registered, full):
            blocks = self.kv.register(req.request_id, i, keys[i])
            if blocks is not None and persist is not None:
                entry = (
                    self.host.reserve(keys[i], self.block_bytes) if self.host is not None else None
                )
                entry = entry or HostBlock(self.block_bytes)
                self.ops.block_saves.append(BlockSave(keys[i], blocks, entry, persist))
        req.num_registered = full

    def _persist_class(self, req: Request) -> str | None:
        if self.store is None or self.classes.retention(req.traffic_class) <= 0:
            return None
        return req.traffic_class

    def _demote(self, key: bytes, blocks: list[int]) -> None:
        """A cached device block is about to be reused: copy it to host memory first."""
        if self.host is None or key in self.host or key in self._loading:
            return  # (a block adopted this round holds nothing yet)
        entry = self.host.reserve(key, self.block_bytes)
        if entry is not None:
            self.ops.block_saves.append(BlockSave(key, blocks, entry, None))

    def leave(self, req: Request, final: bool = False) -> None:
        """The request frees its blocks (finished or preempted): keep what others can reuse."""
        if final:
            self._account(req)
        if req.request_id not in self.kv.tables:
            return
        self.register(req)
        self._snapshot(req, leaving=True)

    def _snapshot(self, req: Request, leaving: bool = False) -> None:
        """Queue SWA saves at the boundaries reached whose window the ring still holds: the
        request's marks, and where it leaves its last boundary (the next turn resumes there).
        The ring keeps W-1+B positions, so a boundary up to one block behind is there."""
        if self.swa is None or req.num_computed < req.replay_until:
            return  # mid-replay the ring is not the sequence's yet
        end = req.num_computed
        due = {m for m in req.swa_marks if m <= end}
        req.swa_marks = [m for m in req.swa_marks if m > end]
        if leaving:
            due.add(min(end, req.num_known_tokens) // self.block * self.block)
        if not due:
            return
        keys = self.keys(req)
        for position in sorted(due):
            index = position // self.block - 1
            if position <= 0 or position < end - self.block or index >= len(keys):
                continue
            if self.swa.peek(keys[index]) is not None:
                continue  # the same tokens give the same window: keep the stored one
            snapshot = self.swa.reserve(keys[index], position, self.swa_bytes)
            if snapshot is not None:
                swa_block = self.kv.tables[req.request_id][self.swa_group][0]
                self.ops.swa_saves.append(SWASave(snapshot, swa_block, position))

    def _account(self, req: Request) -> None:
        s = self.stats
        s.requests += 1
        s.prompt_tokens += req.num_prompt_tokens
        s.hit_tokens += sum(req.cached_tokens_by_tier.values())
        for tier, n in req.cache_lookups.items():
            s.tiers[tier].lookups += n
        for tier, n in req.cache_hits.items():
            s.tiers[tier].hits += n

    # ---- ops for the device worker --------------------------------------------------------

    def take_ops(self) -> CacheOps:
        ops, self.ops = self.ops, CacheOps()
        self._loading.clear()
        return ops

    def completed(self, ops: CacheOps) -> None:
        """The worker ran `ops`: send the blocks worth keeping to the store."""
        host = self.stats.tiers["host"]
        host.bytes_written += self.block_bytes * len(ops.block_saves)
        host.bytes_read += self.block_bytes * sum(load.tier == "host" for load in ops.block_loads)
        if self.store is None:
            return
        for save in ops.block_saves:
            if save.persist_as is not None and save.entry.payload is not None:
                self.store.submit_write(save.key, save.entry.payload, save.persist_as)

    def snapshot_stats(self) -> dict[str, float]:
        out = self.stats.as_dict() | {
            "prefix_cached_blocks": len(self.kv.cached),
            "prefix_cached_bytes": len(self.kv.cached) * self.block_bytes,
        }
        if self.host is not None:
            out |= {"host_cache_blocks": len(self.host), "host_cache_bytes": self.host.bytes}
        if self.store is not None:
            c = self.store.counters  # the store counts its own file bytes
            out |= {
                "prefix_store_bytes_read": c.bytes_read,
                "prefix_store_bytes_written": c.bytes_written,
            }
            out |= {f"kv_store_{k}": v for k, v in vars(c).items()}
        if self.swa is not None:
            out |= self.swa.stats()
        return out
