"""etcd discovery (`--discovery etcd://HOST:PORT`, through aetcd): a node keeps its NodeInfo
JSON at /deepinfer/nodes/<node_id> on an etcd lease of --lease-s, refreshed (and the load
rewritten) every lease/3, and revokes it on drain; a router polls the prefix into its PeerSet.
A key whose lease lapsed is gone from etcd, hence from the set."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import aetcd
import orjson
import structlog

from daemon.cluster.announce import Load
from daemon.cluster.node import NodeInfo, NodeInfoError, Role
from daemon.cluster.peers import PeerSet

log = structlog.get_logger(__name__)

PREFIX = b"/deepinfer/nodes/"
CALL_TIMEOUT_S = 2.0
_FAILURES = (aetcd.ClientError, TimeoutError, OSError)
T = TypeVar("T")


def node_key(node_id: str) -> bytes:
    return PREFIX + node_id.encode()


def _client(host: str, port: int, timeout_s: float) -> aetcd.Client:
    # aetcd puts `timeout` on every gRPC call; _bounded below bounds the connect as well
    return aetcd.Client(host, port, timeout=max(1, math.ceil(timeout_s)))


class EtcdAnnouncer:
    def __init__(self, info: NodeInfo, host: str, port: int, lease_s: float, load: Load) -> None:
        self.info, self.load = info, load
        self.ttl = max(1, math.ceil(lease_s))  # etcd leases are whole seconds
        self.interval = lease_s / 3
        self.timeout = min(self.interval, CALL_TIMEOUT_S)
        self.client = _client(host, port, self.timeout)
        self.where = f"{host}:{port}"
        self.lease: aetcd.Lease | None = None
        self._task: asyncio.Task[None] | None = None
        self._left = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._keep(), name="etcd-announcer")

    async def leave(self) -> None:
        self._left = True
        await _stopped(self._task)
        try:
            if self.lease is not None:  # its key goes with it
                await _bounded(self.lease.revoke(), self.timeout)
                log.info("left_etcd", etcd=self.where, node_id=self.info.node_id)
        except _FAILURES as e:  # the lease lapses instead
            log.warning("leave_failed", etcd=self.where, error=repr(e))
        finally:
            with contextlib.suppress(*_FAILURES):
                await _bounded(self.client.close(), self.timeout)

    async def refresh(self) -> None:
        """The node's key written now, with its current load."""
        await self._beat_now()

    async def set_role(self, role: Role) -> None:
        """The key written again with `role`, now; the beats pause meanwhile, so that no
        value of the old role can land after the new one."""
        self.info = replace(self.info, role=role)
        await self._beat_now()

    async def _beat_now(self) -> None:
        if self._task is None or self._left:  # not started, or left
            return
        await _stopped(self._task)
        try:
            await self._beat()
        except _FAILURES as e:  # the beats try again
            log.warning("etcd_unreachable", etcd=self.where, error=repr(e))
        if not self._left:  # a leave meanwhile: no key again
            self._task = asyncio.create_task(self._keep(), name="etcd-announcer")

    async def _keep(self) -> None:
        await _every(self.interval, self.where, self._beat)

    async def _beat(self) -> None:
        if self.lease is not None:
            reply = await _bounded(self.client.refresh_lease(self.lease.id), self.timeout)
            if reply is None or reply.TTL <= 0:  # lapsed (etcd unreachable too long): a new one
                log.info("etcd_lease_lapsed", etcd=self.where, node_id=self.info.node_id)
                self.lease = None
        fresh = self.lease is None
        if fresh:
            self.lease = await _bounded(self.client.lease(self.ttl), self.timeout)
        value = orjson.dumps(replace(self.info, load=self.load()).to_json())
        await _bounded(
            self.client.put(node_key(self.info.node_id), value, lease=self.lease), self.timeout
        )
        if fresh:
            log.info("registered", etcd=self.where, node_id=self.info.node_id, ttl_s=self.ttl)


class EtcdPeerFeed:
    """Fills `peers` from etcd's /deepinfer/nodes/ every `interval_s` (at most a second): the
    nodes there are upserted with a lease of `lease_s` (so an unreachable etcd empties the set
    rather than keeping nodes nobody vouches for), the ones gone are removed."""

    def __init__(
        self, peers: PeerSet, host: str, port: int, lease_s: float, interval_s: float | None = None
    ) -> None:
        self.peers, self.lease_s = peers, lease_s
        self.interval = interval_s if interval_s is not None else min(1.0, lease_s / 3)
        self.timeout = min(max(self.interval, 0.5), CALL_TIMEOUT_S)
        self.client = _client(host, port, self.timeout)
        self.where = f"{host}:{port}"
        self._known: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._poll(), name="etcd-peer-feed")

    async def stop(self) -> None:
        await _stopped(self._task)
        with contextlib.suppress(*_FAILURES):
            await _bounded(self.client.close(), self.timeout)

    async def sync(self) -> None:
        """One read of the prefix into the peer set."""
        found = await _bounded(self.client.get_prefix(PREFIX), self.timeout)
        seen: set[str] = set()
        for kv in found:
            try:
                info = NodeInfo.from_json(orjson.loads(kv.value))
            except (orjson.JSONDecodeError, NodeInfoError) as e:
                log.warning("etcd_bad_node", key=kv.key.decode(errors="replace"), error=str(e))
                continue
            if node_key(info.node_id) != kv.key:
                log.warning("etcd_bad_node", key=kv.key.decode(errors="replace"), error="key")
                continue
            seen.add(info.node_id)
            self.peers.upsert(info, self.lease_s)
        for node_id in self._known - seen:
            self.peers.remove(node_id)
            log.info("node_left", node_id=node_id, via="etcd")
        for node_id in seen - self._known:
            log.info("node_registered", node_id=node_id, via="etcd")
        self._known = seen

    async def _poll(self) -> None:
        await _every(self.interval, self.where, self.sync)


async def _every(interval: float, where: str, work: Callable[[], Awaitable[None]]) -> None:
    """`work` every `interval` seconds, for ever; etcd being unreachable is logged once per
    outage, not per try."""
    loop = asyncio.get_running_loop()
    reachable = True
    while True:
        started = loop.time()
        try:
            await work()
            if not reachable:
                log.info("etcd_reachable", etcd=where)
            reachable = True
        except _FAILURES as e:
            if reachable:
                log.warning("etcd_unreachable", etcd=where, error=repr(e))
            reachable = False
        await asyncio.sleep(max(0.0, interval - (loop.time() - started)))


async def _bounded(aw: Awaitable[T], seconds: float) -> T:
    """`aw` within `seconds`, else TimeoutError. Not asyncio.wait_for: on 3.11 it drops a cancel
    that lands as the call completes, and the cancelled beat loop then runs on for ever."""
    async with asyncio.timeout(seconds):
        return await aw


async def _stopped(task: asyncio.Task[None] | None) -> None:
    """`task` cancelled and finished: cancelled again while it keeps running (a cancel that a
    library swallowed), so that whoever stops it never waits on it for ever."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if task is not None and not task.cancelled():
        with contextlib.suppress(asyncio.CancelledError, *_FAILURES):
            task.result()
