"""HTTP discovery in one process, over real sockets: the registration routes on an aiohttp
server, HttpRegistrars registering, heartbeating, re-registering after a registry restart and
leaving; bad bodies get JSON errors; a dead or silent registry never holds a node up."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from daemon.cluster.node import NodeInfo
from daemon.cluster.peers import PeerSet
from daemon.cluster.registrar import HttpRegistrar
from daemon.cluster.registry_routes import NODES, add_registry_routes
from daemon.service.live_server import free_port


def _node(node_id: str = "p0", role: str = "prefill", epoch: int = 10) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=role,  # type: ignore[arg-type]
        fingerprint="fp",
        url="http://127.0.0.1:9",
        epoch=epoch,
        served_model="tiny",
        capacity={"kv_blocks": 8, "max_num_seqs": 2},
    )


class Registry:
    """The routes on a real listening socket; restartable on the same port with an empty set."""

    def __init__(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.runner: web.AppRunner | None = None
        self.peers = PeerSet()

    async def start(self) -> None:
        self.peers = PeerSet()
        app = web.Application()
        add_registry_routes(app, self.peers)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def registry() -> AsyncIterator[Registry]:
    reg = Registry(free_port())
    await reg.start()
    yield reg
    await reg.stop()


async def _until(check, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_register_heartbeat_restart_leave(registry: Registry) -> None:
    load = {"running": 0, "waiting": 0, "kv_blocks_free": 8}
    reg = HttpRegistrar(_node(), [registry.url], lease_s=1.5, load=lambda: dict(load))
    await reg.start()
    await _until(lambda: registry.peers.get("p0") is not None)
    load["running"] = 2  # the next heartbeat carries it
    await _until(lambda: registry.peers.get("p0").load["running"] == 2)
    async with aiohttp.ClientSession() as s, s.get(registry.url + NODES) as resp:
        listed = (await resp.json())["data"]
    assert [n["node_id"] for n in listed] == ["p0"] and listed[0]["role"] == "prefill"
    assert 0 < listed[0]["expires_in_s"] <= 1.5
    await registry.stop()  # restarted: it forgets every node
    await registry.start()
    assert registry.peers.get("p0") is None
    await _until(lambda: registry.peers.get("p0") is not None, timeout=3)
    start = time.monotonic()
    await reg.leave()
    assert time.monotonic() - start < 1 and registry.peers.get("p0") is None


async def test_lapsed_lease_and_stale_epochs(registry: Registry) -> None:
    async with aiohttp.ClientSession() as s:
        body = _node(epoch=10).to_json() | {"ttl_s": 1}
        async with s.post(registry.url + NODES, json=body) as resp:
            assert resp.status == 200
        old = _node(epoch=9).to_json() | {"ttl_s": 1}  # an older process of the same node
        async with s.post(registry.url + NODES, json=old) as resp:
            assert resp.status == 409 and (await resp.json())["error"]["code"] == "stale_epoch"
        beat = {"epoch": 9, "load": {}}
        async with s.put(f"{registry.url}{NODES}/p0", json=beat) as resp:
            assert resp.status == 409
        async with s.delete(f"{registry.url}{NODES}/p0", params={"epoch": "9"}) as resp:
            assert (await resp.json())["removed"] is False  # not the old process's to remove
        assert registry.peers.get("p0").epoch == 10
        await asyncio.sleep(1.1)  # no heartbeat: the lease lapsed
        async with s.get(registry.url + NODES) as resp:
            assert (await resp.json())["data"] == []
        beat = {"epoch": 10, "load": {}}
        async with s.put(f"{registry.url}{NODES}/p0", json=beat) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_node"


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    [
        ("POST", NODES, b"{not json", None),
        ("POST", NODES, b"[1]", None),
        ("POST", NODES, {"ttl_s": 5}, "node_id"),
        ("POST", NODES, _node().to_json(), "ttl_s"),
        ("POST", NODES, _node().to_json() | {"ttl_s": 0.1}, "ttl_s"),
        ("POST", NODES, _node().to_json() | {"ttl_s": 5, "role": "chef"}, "role"),
        ("POST", NODES, _node(node_id="a b").to_json() | {"ttl_s": 5}, "node_id"),
        ("PUT", NODES + "/p0", {"load": {}}, "epoch"),
        ("PUT", NODES + "/p0", {"epoch": 1, "load": {"running": -1}}, "load"),
        ("DELETE", NODES + "/p0?epoch=x", None, "epoch"),
        ("GET", NODES + "?role=chef", None, "role"),
    ],
)
async def test_bad_requests_get_json_errors(
    registry: Registry, method: str, path: str, body: object, param: str | None
) -> None:
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with aiohttp.ClientSession() as s, s.request(method, registry.url + path, **kwargs) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


async def test_dead_and_silent_registries_never_hold_the_node(registry: Registry) -> None:
    silent = socket.socket()  # accepts connections (the kernel does) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    urls = [dead, f"http://127.0.0.1:{silent.getsockname()[1]}", registry.url]
    reg = HttpRegistrar(_node(), urls, lease_s=1.5, load=lambda: {})
    try:
        start = time.monotonic()
        await reg.start()
        assert time.monotonic() - start < 0.1
        await _until(lambda: registry.peers.get("p0") is not None, timeout=2)  # the live one
        start = time.monotonic()
        await reg.leave()
        assert time.monotonic() - start < 1.5  # the silent one's DELETE is cut off
        assert registry.peers.get("p0") is None
    finally:
        silent.close()
