"""The prefix cache: the longest block-aligned prefix a waiting request shares with earlier
ones, found on the device, in host memory or in the block store, and its sliding-window state."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict

import torch

from daemon.kv.block_store import BlockStore
from daemon.kv.host_tier import HostBlock
from daemon.kv.manager import KVManager
from daemon.kv.prefix_hash import block_hashes
from daemon.kv.request_state import PrefixRequest
from daemon.kv.swa_cache import SWACache
from daemon.kv.swa_marks import chunk_limit, due_marks, snapshot_marks
from daemon.kv.swa_policy import POLICIES
from daemon.kv.tier_ops import CacheOps, RestoreOp, TierQueue
from daemon.kv.tier_stats import CacheStats
from daemon.kv.traffic import TrafficClasses

MAX_PROBES = 3  # store re-reads for one request whose in-memory prefix was evicted meanwhile
TOUCH_EVERY_S = 3600.0  # refresh a device/host hit's store file at most this often
_MAX_TOUCHED = 1 << 16


class PrefixCache:
    """Prefix reuse across the device, host and store tiers. Contracts, as the scheduler and
    the engine use them:

    match   `admit` finds a waiting request's longest cached prefix, or first asks for store
            reads (`store_keys` on arrival; `admit`'s return when memory lost blocks while
            it waited); their payloads come back through `receive`
    lock    a hit's device blocks are referenced by the request's tables (KVManager.take_cached,
            adopt) until `leave`; then they sit in the LRU free list, still findable
    insert  `register` makes a running request's full, computed blocks findable and queues
            their persistence per its traffic class
    evict   a cached device block is forgotten when its pool hands it out again;
            TierQueue.demote (the KV manager's `on_evict`) copies it to host memory first

    Tier moves wait on a TierQueue (kv/tier_ops.py): the engine takes them each step
    (`take_ops`) for the device worker and reports them done (`completed`).

    Sliding-window snapshots (kv/swa_marks.py) are taken at each prompt's last full block
    (what a repeat, or a request sharing those blocks, resumes from), where a request leaves
    (the next turn), and at a boundary where a lookup missed (a prefix found shared: later
    requests hit there). On an SWA-state miss the policy decides:

    replay  recompute the last layers x (W-1) tokens before the boundary, their window limited
            to the replayed range: each layer's window reaches W-1 tokens further back, so the
            state it leaves is exact, at a cost that does not grow with the context
    window  the seed's bounded replay: recompute only the last W tokens, their window limited
            to them (constant and smallest cost; the state, and the snapshots taken after it,
            are approximate)
    exact   resume from the last boundary whose SWA state is stored, or from scratch
    """

    def __init__(
        self,
        kv: KVManager,
        queue: TierQueue,
        salt: bytes,
        *,
        store: BlockStore | None = None,
        classes: TrafficClasses | None = None,
        swa: SWACache | None = None,
        swa_bytes: int = 0,
        replay_tokens: int = 0,
        policy: str = "replay",
    ) -> None:
        """`queue` is the one `kv` was given the demotion of; `swa` with a model whose KV
        has a sliding-window group (kv.swa_group)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown SWA-miss policy {policy!r}; use one of {POLICIES}")
        if swa is not None and kv.swa_group is None:
            raise ValueError("an SWA snapshot cache needs a model with a sliding-window group")
        self.kv, self.queue, self.salt = kv, queue, salt
        self.block = kv.prefix_block
        self.block_bytes, self.host, self.store = queue.block_bytes, queue.host, store
        self.classes = classes or TrafficClasses()
        self.swa, self.swa_bytes = swa, swa_bytes
        self.replay_tokens, self.policy = replay_tokens, policy
        self._touched: OrderedDict[bytes, float] = OrderedDict()
        self.stats = CacheStats()

    def keys(self, req: PrefixRequest) -> list[bytes]:
        st = req.prefix
        tokens = req.prompt_ids + req.output_ids
        salt = self.salt + st.cache_salt
        st.block_keys = block_hashes(tokens, self.block, salt, st.block_keys, st.content)
        return st.block_keys

    def _usable_keys(self, req: PrefixRequest) -> list[bytes]:
        if req.params.prompt_logprobs is not None:
            return []  # each prompt position's logits are needed: no cached prefix (as vLLM)
        return self.keys(req)[: (req.num_known_tokens - 1) // self.block]  # a token to compute

    def _in_memory(self, key: bytes) -> bool:
        return key in self.kv.cached or (self.host is not None and key in self.host)

    def _leading(self, req: PrefixRequest, keys: list[bytes]) -> int:
        """How many leading keys some tier holds (memory, or read from the store for `req`)."""
        loaded = req.prefix.loaded
        n = 0
        while n < len(keys) and (self._in_memory(keys[n]) or keys[n] in loaded):
            n += 1
        return n

    # ---- before admission: the block store ------------------------------------------------

    def store_keys(self, req: PrefixRequest) -> list[bytes]:
        """The keys past the prefix held in memory, to look for in the block store."""
        if self.store is None:
            return []
        keys = self._usable_keys(req)
        n = self._leading(req, keys)
        req.prefix.store_checked = n  # the keys before were in memory at this point
        return keys[n:]

    def receive(self, req: PrefixRequest, keys: list[bytes], payloads: list[torch.Tensor]) -> None:
        """Blocks the store had for the request: held for its admission, and in host memory."""
        st, lookups = req.prefix, req.cache.lookups
        if not lookups.get("store"):
            lookups["store"] = len(payloads) + (1 if len(payloads) < len(keys) else 0)
        st.store_checked += len(payloads)
        for key, payload in zip(keys, payloads):
            st.loaded[key] = payload
            if self.host is not None:
                self.host.put(key, payload)

    # ---- admission --------------------------------------------------------------------------

    def admit(self, req: PrefixRequest, first: bool = True) -> list[bytes] | None:
        """Called before a request's first step (new, or recomputing after preemption: `first`
        False, its statistics stay those of its first admission). Returns keys to read from
        the block store first when blocks that were in memory when the request arrived have
        been evicted while it waited; None once it is admitted."""
        st, use = req.prefix, req.cache
        keys = self._usable_keys(req)
        n = self._leading(req, keys)
        if self.store is not None and n < st.store_checked and st.store_probes < MAX_PROBES:
            st.store_probes += 1
            st.store_checked = n
            return keys[n:]
        if first:
            on_device = sum(1 for k in keys[:n] if k in self.kv.cached)
            missed = 1 if n < len(keys) else 0
            use.lookups["device"] = n + missed
            use.lookups["host"] = (n - on_device + missed) if self.host is not None else 0
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
        if first:
            use.hits = dict(hits)
            left, use.tokens_by_tier = req.num_prompt_tokens, {}
            for tier, blocks in hits.items():
                use.tokens_by_tier[tier] = min(blocks * self.block, left)
                left -= use.tokens_by_tier[tier]
        position = n * self.block
        if n:
            req.num_computed = use.num_cached_tokens = position
            st.num_registered = n
        if self.swa is not None:
            if n:
                st.pending_restore = RestoreOp(position, snapshot)
            if n and snapshot is None:  # replay the window's reach before the boundary
                st.replay_until = position
                st.replay_from = req.num_computed = position - min(self.replay_tokens, position)
                use.num_cached_tokens = req.num_computed
            st.swa_marks = snapshot_marks(
                req.num_known_tokens, req.num_computed, position, missed_at, self.block
            )
        return None

    def imported(self, req: PrefixRequest) -> None:
        """A request admitted with its prompt's KV imported (a handoff), past `admit`: its
        sliding window is snapshotted where an admission would have marked it (the prompt's
        last full blocks, still in the ring), for a repeat of the prompt here to resume."""
        if self.swa is not None:
            req.prefix.swa_marks = snapshot_marks(req.num_known_tokens, 0, 0, 0, self.block)

    def chunk_limit(self, req: PrefixRequest, n: int) -> int:
        """At most `n` tokens for the request's next chunk, ending where the SWA ring still
        holds the window before its next snapshot boundary (one block past it)."""
        marks = req.prefix.swa_marks
        return chunk_limit(marks, req.num_computed, n, self.block) if marks else n

    def _take(self, req: PrefixRequest, keys: list[bytes]) -> Counter[str]:
        """Put the blocks of `keys` at the head of the request's tables, loading those that are
        not on the device; stops early when the device has no block to load into."""
        hits: Counter[str] = Counter()
        loaded = req.prefix.loaded
        resident = []  # hits from memory: uses the store does not see
        for key in keys:
            if key in self.kv.cached:
                self.kv.take_cached(req.request_id, key)
                hits["device"] += 1
                resident.append(key)
                continue
            if key in loaded:
                tier, entry = "store", HostBlock(self.block_bytes, loaded[key])
            else:
                tier, entry = "host", self.host.get(key) if self.host is not None else None
            blocks = self.kv.adopt(req.request_id, key) if entry is not None else None
            if blocks is None:
                break
            self.queue.load(key, blocks, entry, tier)
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

    def register(self, req: PrefixRequest) -> None:
        """Make the request's full, computed blocks findable, and persist them per its class;
        snapshot the sliding window at the boundaries it has reached."""
        st = req.prefix
        if st.swa_marks:
            self._snapshot(req)
        full = min(req.num_computed, req.num_known_tokens) // self.block
        if full <= st.num_registered:
            return
        keys = self.keys(req)
        persist = self._persist_class(st.traffic_class)
        for i in range(st.num_registered, full):
            blocks = self.kv.register(req.request_id, i, keys[i])
            if blocks is not None and persist is not None:
                self.queue.save(keys[i], blocks, persist)
        st.num_registered = full

    def _persist_class(self, traffic_class: str) -> str | None:
        if self.store is None or self.classes.retention(traffic_class) <= 0:
            return None
        return traffic_class

    def leave(self, req: PrefixRequest, final: bool = False) -> None:
        """The request frees its blocks (finished or preempted): keep what others can reuse."""
        if final:
            self._account(req)
        if req.request_id not in self.kv.tables:
            return
        self.register(req)
        self._snapshot(req, leaving=True)

    def _snapshot(self, req: PrefixRequest, leaving: bool = False) -> None:
        """Queue SWA saves at the boundaries reached whose window the ring still holds."""
        st = req.prefix
        if self.swa is None or req.num_computed < st.replay_until:
            return  # mid-replay the ring is not the sequence's yet
        end = req.num_computed
        due = due_marks(st.swa_marks, end, req.num_known_tokens, leaving, self.block)
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
                swa_block = self.kv.swa_block(req.request_id)
                self.queue.save_swa(snapshot, swa_block, position)

    def _account(self, req: PrefixRequest) -> None:
        s, use = self.stats, req.cache
        s.requests += 1
        s.prompt_tokens += req.num_prompt_tokens
        s.hit_tokens += sum(use.tokens_by_tier.values())
        for tier, n in use.lookups.items():
            s.tiers[tier].lookups += n
        for tier, n in use.hits.items():
            s.tiers[tier].hits += n

    # ---- ops for the device worker --------------------------------------------------------

    def take_ops(self) -> CacheOps:
        return self.queue.take()

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
