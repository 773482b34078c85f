"""The set of live peers a router (or a seed peer) knows: each entry holds a lease that a
heartbeat renews; an entry whose lease lapsed is gone. Time comes from an injectable clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from daemon.cluster.node import NodeInfo, Role


@dataclass
class _Entry:
    info: NodeInfo
    ttl_s: float
    expires: float


class PeerSet:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def upsert(self, info: NodeInfo, ttl_s: float) -> None:
        """Registers (or replaces) a node; its lease runs `ttl_s` from now. A registration
        with an older epoch than the live entry's is a stale process: ignored."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        now = self._clock()
        old = self._live_entry(info.node_id, now)
        if old is not None and info.epoch < old.info.epoch:
            return
        self._entries[info.node_id] = _Entry(info, ttl_s, now + ttl_s)

    def renew(self, node_id: str, load: dict[str, int]) -> bool:
        """A heartbeat: the lease runs its ttl again and the load is replaced. False when the
        node is not (or no longer) in the set: it has to register again."""
        now = self._clock()
        entry = self._live_entry(node_id, now)
        if entry is None:
            return False
        entry.info = replace(entry.info, load=dict(load))
        entry.expires = now + entry.ttl_s
        return True

    def remove(self, node_id: str) -> None:
        self._entries.pop(node_id, None)

    def live(self, role: Role | None = None, fingerprint: str | None = None) -> list[NodeInfo]:
        """The nodes whose lease holds, by node id; only `role` / `fingerprint` ones if given
        (nodes of different models are never paired: ask with the fingerprint)."""
        now = self._clock()
        self._expire(now)
        return [
            e.info
            for _, e in sorted(self._entries.items())
            if (role is None or e.info.role == role)
            and (fingerprint is None or e.info.fingerprint == fingerprint)
        ]

    def get(self, node_id: str) -> NodeInfo | None:
        entry = self._live_entry(node_id, self._clock())
        return entry.info if entry is not None else None

    def expires_in(self, node_id: str) -> float | None:
        """Seconds left on a live node's lease (None: not in the set)."""
        now = self._clock()
        entry = self._live_entry(node_id, now)
        return entry.expires - now if entry is not None else None

    def _live_entry(self, node_id: str, now: float) -> _Entry | None:
        entry = self._entries.get(node_id)
        if entry is not None and entry.expires <= now:
            del self._entries[node_id]
            return None
        return entry

    def _expire(self, now: float) -> None:
        for node_id in [k for k, e in self._entries.items() if e.expires <= now]:
            del self._entries[node_id]
