"""etcd discovery against a real etcd on loopback: a router finds a prefill and a decode node
there and a request through it is handed off (the decode node names its router: --routers); a
daemon keeps its NodeInfo under /deepinfer/nodes/<id> on a lease; a router-side EtcdPeerFeed
sees it come, lapse (frozen), come back with a new lease and leave (SIGTERM); a lease revoked
under a live announcer is taken again; a role change rewrites the key at once; a dead etcd
holds nobody up."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aetcd
import orjson
import pytest

from daemon.cluster.etcd import EtcdAnnouncer, EtcdPeerFeed, node_key
from daemon.cluster.node import NodeInfo
from daemon.cluster.peers import PeerSet
from daemon.service.live_server import free_port
from tests.etcd import Etcd, etcd_server
from tests.test_cluster_daemons import LEASE_S, Proc, node_args, until


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    root = tmp_path_factory.mktemp("etcd")
    with etcd_server(root / "data", root / "etcd.log") as server:
        yield server


@pytest.fixture(scope="module")
def router_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def etcd_node(
    etcd: Etcd, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, router_port: int
) -> Iterator[Proc]:
    log = tmp_path_factory.mktemp("etcd-cluster-logs") / "ed0.log"
    args = node_args(
        tiny_model_dir, "--role", "decode", "--discovery", etcd.url, "--node-id", "ed0"
    )
    args += ["--routers", f"http://127.0.0.1:{router_port}"]
    proc = Proc(free_port(), args, log).start()
    try:
        yield proc.wait()
    finally:
        proc.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def etcd_cluster(
    etcd: Etcd,
    etcd_node: Proc,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    router_port: int,
) -> Iterator[tuple[Proc, Proc]]:
    """A router and a prefill node that find each other, and the decode node, in etcd."""
    logs = tmp_path_factory.mktemp("etcd-router-logs")
    router_args = ["--role", "router", "--discovery", etcd.url, "--lease-s", str(LEASE_S)]
    router = Proc(router_port, [*router_args, "--log-format", "json"], logs / "router.log")
    prefill_args = ["--role", "prefill", "--discovery", etcd.url, "--node-id", "ep0"]
    prefill = Proc(free_port(), node_args(tiny_model_dir, *prefill_args), logs / "ep0.log")
    try:
        yield router.start().wait(), prefill.start().wait()
    finally:
        for proc in (prefill, router):
            if proc.proc is not None:
                proc.stop(signal.SIGKILL)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_a_request_through_a_router_in_etcd_is_handed_off(
    etcd_cluster: tuple[Proc, Proc], etcd_node: Proc
) -> None:
    router, prefill = etcd_cluster
    roles = {"prefill": 1, "decode": 1, "unified": 0}
    until(lambda: _get(router.url + "/health")["nodes"] == roles, timeout=20)
    body = {"model": "tiny", "prompt": list(range(1000, 1040)), "max_tokens": 4}
    request = urllib.request.Request(
        router.url + "/v1/completions",
        data=json.dumps(body | {"temperature": 0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == 4
    assert _get(etcd_node.url + "/health")["kv_handoff_imported"] == 1
    assert _get(prefill.url + "/health")["kv_handoff_exported"] == 1


async def _until(check: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def _ids(peers: PeerSet) -> set[str]:
    return {n.node_id for n in peers.live()}


async def test_a_daemon_in_etcd_lapses_returns_and_leaves(etcd: Etcd, etcd_node: Proc) -> None:
    peers = PeerSet()
    feed = EtcdPeerFeed(peers, etcd.host, etcd.port, LEASE_S)
    await feed.start()
    assert etcd_node.proc is not None
    try:
        await _until(lambda: "ed0" in _ids(peers), timeout=10)

        def idle() -> bool:  # an earlier test's request may be in the last heartbeat still
            n = peers.get("ed0")
            return n is not None and n.load["kv_blocks_free"] == n.capacity["kv_blocks"] > 0

        await _until(idle, timeout=LEASE_S + 2)
        d0 = peers.get("ed0")
        assert d0.role == "decode" and d0.url == etcd_node.url and len(d0.fingerprint) == 64
        async with aetcd.Client(etcd.host, etcd.port, timeout=2) as client:
            kv = await client.get(node_key("ed0"))
            assert kv is not None and kv.lease != 0  # on a lease
            assert NodeInfo.from_json(orjson.loads(kv.value)) == d0
        etcd_node.proc.send_signal(signal.SIGSTOP)  # as good as dead: no keepalive
        try:
            gone = await _until(lambda: "ed0" not in _ids(peers), timeout=LEASE_S + 4)
        finally:
            etcd_node.proc.send_signal(signal.SIGCONT)
        assert gone > 0.3  # its lease lapsed in etcd
        # thawed, it finds its lease gone and takes a new one
        await _until(lambda: "ed0" in _ids(peers), timeout=LEASE_S + 2)
        etcd_node.proc.send_signal(signal.SIGTERM)
        await _until(lambda: "ed0" not in _ids(peers), timeout=1.5)
        assert await asyncio.to_thread(etcd_node.proc.wait, 20) == 0
        assert '"left_etcd"' in etcd_node.log.read_text()  # revoked, not lapsed
    finally:
        await feed.stop()


def _info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, "decode", "fp", "http://127.0.0.1:9", 1, "tiny", {}, {})


async def test_a_lost_lease_is_taken_again(etcd: Etcd) -> None:
    announcer = EtcdAnnouncer(_info("lost0"), etcd.host, etcd.port, 3.0, lambda: {"running": 1})
    await announcer.start()
    try:
        async with aetcd.Client(etcd.host, etcd.port, timeout=2) as client:
            deadline = time.monotonic() + 5
            while await client.get(node_key("lost0")) is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            first = announcer.lease
            assert first is not None
            await client.revoke_lease(first.id)  # as if etcd had been out of reach past the TTL
            assert await client.get(node_key("lost0")) is None
            deadline = time.monotonic() + 4
            while (kv := await client.get(node_key("lost0"))) is None:
                assert time.monotonic() < deadline, "not registered again"
                await asyncio.sleep(0.05)
            assert kv.lease != first.id
            assert orjson.loads(kv.value)["load"] == {"running": 1}
    finally:
        await announcer.leave()
    async with aetcd.Client(etcd.host, etcd.port, timeout=2) as client:
        assert await client.get(node_key("lost0")) is None


async def test_a_dead_etcd_holds_nobody_up() -> None:
    port = free_port()  # nothing listens
    announcer = EtcdAnnouncer(_info("dead0"), "127.0.0.1", port, 3.0, lambda: {})
    feed = EtcdPeerFeed(PeerSet(), "127.0.0.1", port, 3.0)
    start = time.monotonic()
    await announcer.start()
    await feed.start()
    assert time.monotonic() - start < 0.1
    await asyncio.sleep(1.5)  # a few failed beats and polls
    start = time.monotonic()
    await announcer.leave()
    await feed.stop()
    assert time.monotonic() - start < 2.5


async def test_a_role_change_rewrites_the_key_at_once(etcd: Etcd) -> None:
    draining = {"now": 0}
    load = lambda: {"running": 0} | ({"draining": 1} if draining["now"] else {})  # noqa: E731
    announcer = EtcdAnnouncer(_info("role0"), etcd.host, etcd.port, 30.0, load)  # beats every 10 s
    await announcer.start()
    try:
        async with aetcd.Client(etcd.host, etcd.port, timeout=2) as client:

            async def value() -> dict | None:
                kv = await client.get(node_key("role0"))
                return None if kv is None else orjson.loads(kv.value)

            deadline = time.monotonic() + 5
            while await value() is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            draining["now"] = 1
            await announcer.refresh()
            assert (await value())["load"] == {"running": 0, "draining": 1}
            draining["now"] = 0
            await announcer.set_role("prefill")
            now = await value()
            assert now["role"] == "prefill" and now["load"] == {"running": 0}
    finally:
        await announcer.leave()
    await announcer.set_role("decode")  # after leaving: no key again
    async with aetcd.Client(etcd.host, etcd.port, timeout=2) as client:
        assert await client.get(node_key("role0")) is None
