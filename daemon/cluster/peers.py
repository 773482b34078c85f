"""The set of live peers a router (or a seed peer) knows: each entry holds a lease that a
heartbeat renews; an entry whose lease lapsed is gone. Time comes from an injectable clock."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from daemon.cluster.node import NodeInfo, Role


@dataclass
class _Entry:
    info: NodeInfo
    ttl_s: float
    expires: float
    beat: int  # which registration or heartbeat gave its load (rises with each)


class PeerSet:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        # nodes whose lease lapsed (not those that left), and when: a starved node comes back
        self._lapsed: dict[str, tuple[NodeInfo, float]] = {}
        self._beats = itertools.count(1)

    def upsert(self, info: NodeInfo, ttl_s: float) -> None:
        """Registers (or replaces) a node; its lease runs `ttl_s` from now. A registration
        with an older epoch than the live entry's is a stale process: ignored."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        now = self._clock()
        old = self._live_entry(info.node_id, now)
        if old is not None and info.epoch < old.info.epoch:
            return
        self._entries[info.node_id] = _Entry(info, ttl_s, now + ttl_s, next(self._beats))
        self._lapsed.pop(info.node_id, None)

    def renew(self, node_id: str, load: dict[str, int]) -> bool:
        """A heartbeat: the lease runs its ttl again and the load is replaced. False when the
        node is not (or no longer) in the set: it has to register again."""
        now = self._clock()
        entry = self._live_entry(node_id, now)
        if entry is None:
            return False
        entry.info = replace(entry.info, load=dict(load))
        entry.expires = now + entry.ttl_s
        entry.beat = next(self._beats)
        return True

    def beat(self, node_id: str) -> int | None:
        """Which load report a node's entry holds: it changes with each heartbeat (None: not
        in the set). What was sent to the node since is not in that load yet."""
        entry = self._entries.get(node_id)
        return entry.beat if entry is not None else None

    def remove(self, node_id: str) -> None:
        self._entries.pop(node_id, None)
        self._lapsed.pop(node_id, None)

    def lapsed_since(self, within_s: float) -> list[NodeInfo]:
        """The nodes whose lease lapsed within the last `within_s` and that have not
        registered again (a node that left is not among them)."""
        now = self._clock()
        self._expire(now)
        for node_id in [k for k, (_, t) in self._lapsed.items() if now - t > within_s]:
            del self._lapsed[node_id]
        return [info for info, _ in self._lapsed.values()]

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
            self._lapse(node_id, entry)
            return None
        return entry

    def _expire(self, now: float) -> None:
        for node_id, entry in [(k, e) for k, e in self._entries.items() if e.expires <= now]:
            self._lapse(node_id, entry)

    def _lapse(self, node_id: str, entry: _Entry) -> None:
        del self._entries[node_id]
        self._lapsed[node_id] = (entry.info, entry.expires)
