"""Prefix reuse on admission: take the longest cached block-aligned prefix, and for models
with sliding-window state (DeepSeek-V4) bring that state back too.

On an SWA-state miss the policy decides:
  replay  recompute only the last `sliding_window` tokens before the boundary, their
          window limited to the replayed range (bounded cost, a small measured divergence)
  exact   resume from the last boundary whose SWA state is stored, or from scratch
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.kv.manager import KVManager
from daemon.kv.prefix_hash import block_hashes
from daemon.kv.swa_cache import SWACache, SWASnapshot
from daemon.loop.request import Request

POLICIES = ("replay", "exact")


@dataclass
class RestoreOp:
    """Before the request's first step: per-request state at `position` (snapshot None =
    only the block-boundary compressor state; the sliding window comes from a replay)."""

    position: int
    snapshot: SWASnapshot | None


@dataclass
class SaveOp:
    snapshot: SWASnapshot
    swa_block: int
    position: int


class PrefixCache:
    def __init__(
        self,
        kv: KVManager,
        salt: bytes,
        swa: SWACache | None = None,
        swa_group: int = -1,
        swa_bytes: int = 0,
        window: int = 0,
        policy: str = "replay",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown SWA-miss policy {policy!r}; use one of {POLICIES}")
        self.kv, self.salt, self.swa = kv, salt, swa
        self.block = kv.prefix_block
        self.swa_group, self.swa_bytes, self.window, self.policy = (
            swa_group,
            swa_bytes,
            window,
            policy,
        )
        self.pending_saves: list[SaveOp] = []
        self.lookups = self.hit_blocks = 0

    def keys(self, req: Request) -> list[bytes]:
        tokens = req.prompt_ids + req.output_ids
        req.block_keys = block_hashes(
            tokens, self.block, self.salt + req.cache_salt, req.block_keys
        )
        return req.block_keys

    def admit(self, req: Request) -> None:
        """Called before a request's first step (new, or recomputing after preemption)."""
        self.lookups += 1
        usable = (req.num_known_tokens - 1) // self.block  # leave a token to compute
        keys = self.keys(req)[:usable]
        blocks = self.kv.cached_prefix(keys)
        if blocks == 0:
            return
        if self.swa is None:
            self._take(req, keys[:blocks], blocks * self.block)
            return
        snapshot = self.swa.get(keys[blocks - 1])
        if snapshot is None and self.policy == "exact":
            while blocks and snapshot is None:
                blocks -= 1
                snapshot = self.swa.get(keys[blocks - 1]) if blocks else None
            if blocks == 0:
                return
        position = blocks * self.block
        self._take(req, keys[:blocks], position)
        req.pending_restore = RestoreOp(position, snapshot)
        if snapshot is None:  # bounded replay of the last window before the boundary
            req.replay_until = position
            req.replay_from = req.num_computed = position - min(self.window, position)
            req.num_cached_tokens = req.num_computed

    def _take(self, req: Request, keys: list[bytes], position: int) -> None:
        self.kv.take_prefix(req.request_id, keys)
        self.hit_blocks += len(keys)
        req.num_computed = req.num_cached_tokens = position
        req.num_registered = len(keys)

    def register(self, req: Request) -> None:
        """Make the request's full, computed blocks findable."""
        full = min(req.num_computed, req.num_known_tokens) // self.block
        if full <= req.num_registered:
            return
        keys = self.keys(req)
        for i in range(req.num_registered, full):
            self.kv.register(req.request_id, i, keys[i])
        req.num_registered = full

    def leave(self, req: Request) -> None:
        """The request frees its blocks (finished or preempted): keep what others can reuse."""
        if req.request_id not in self.kv.tables:
            return
        self.register(req)
        if self.swa is None or req.num_computed < req.replay_until:
            return
        position = req.num_computed // self.block * self.block
        if position == 0:
            return
        snapshot = self.swa.reserve(
            self.keys(req)[position // self.block - 1], position, self.swa_bytes
        )
        if snapshot is not None:
            swa_block = self.kv.tables[req.request_id][self.swa_group][0]
            self.pending_saves.append(SaveOp(snapshot, swa_block, position))

    def take_saves(self) -> list[SaveOp]:
        saves, self.pending_saves = self.pending_saves, []
        return saves
