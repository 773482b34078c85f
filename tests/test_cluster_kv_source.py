"""HttpKVSource against a real aiohttp server that plays router and prefill node and spoils the
payload on the way (altered, cut short, connection dropped, frozen, stale epoch): every fault
ends in HandoffFailed / TimeoutError / OSError within the timeout, never an export."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import torch
from aiohttp import web

from daemon.cluster.kv_source import HttpKVSource
from daemon.cluster.wire import CONTENT_TYPE, HandoffMeta, PayloadRejected, encode
from daemon.loop.handoff import Fetched, HandoffFailed, StoreOffer, after_blocks
from daemon.models.base import KVExport, RequestState

PROMPT = list(range(100, 140))
END = len(PROMPT) - 1
EPOCH = 5
KEYS = [bytes(16), bytes([1]) * 16]
OFFER = StoreOffer("store-a", "ab" * 16, 16)


def _export() -> KVExport:
    g = torch.Generator().manual_seed(1)
    blocks = {0: [torch.randn(3, 16, 2, 8, generator=g) for _ in range(4)]}
    return KVExport(0, END, blocks, RequestState(END))


class Peer:
    """The router's /route/prefill and the prefill node's /prefill; `fault` spoils the answer."""

    def __init__(self) -> None:
        self.fault = ""
        self.routes: list[dict] = []
        self.bodies: list[dict] = []
        self.url = ""

    async def route(self, request: web.Request) -> web.Response:
        self.routes.append(await request.json())
        if self.fault == "no_prefill":
            return web.json_response({"error": {"message": "none"}}, status=503)
        answer = {"node_id": "p0", "url": self.url, "epoch": EPOCH, "lease_ms": 5000}
        return web.json_response(answer)

    async def prefill(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["epoch"] != EPOCH or self.fault == "stale":
            return web.json_response({"error": {"code": "stale_epoch"}}, status=409)
        meta = HandoffMeta(
            body["request_id"] + ("x" if self.fault == "other_id" else ""),
            EPOCH,
            body["prefix_hash"],
            time.time() + body["lease_ms"] / 1000,
            "fp",
        )
        got = Fetched(_export())
        if self.fault == "stored":  # the first block left in the store
            got = Fetched(after_blocks(_export(), 1, 16), [KEYS[0]])
        data = b"".join([bytes(c) async for c in encode(got, meta)])
        if self.fault == "frozen":
            await asyncio.sleep(3600)
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        await response.prepare(request)
        if self.fault == "altered":
            data = data[:2000] + bytes([data[2000] ^ 1]) + data[2001:]
        if self.fault == "short":
            data = data[: len(data) // 2]
        if self.fault == "dropped":
            await response.write(data[: len(data) // 2])
            request.transport.close()
            return response
        await response.write(data)
        await response.write_eof()
        return response


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    peer = Peer()
    app = web.Application()
    app.router.add_post("/cluster/v1/route/prefill", peer.route)
    app.router.add_post("/cluster/v1/prefill", peer.prefill)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # a frozen handler is not waited for
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    peer.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield peer
    await runner.cleanup()


async def _fetched(
    peer: Peer, timeout_s: float = 5.0, router: str | None = None, store: StoreOffer | None = None
) -> Fetched:
    async with aiohttp.ClientSession() as session:
        source = HttpKVSource(session, router or peer.url, "h1", "fp", timeout_s, cache_salt=b"s")
        return await source.fetch(PROMPT, KEYS, END, store)


async def _fetch(peer: Peer, timeout_s: float = 5.0, router: str | None = None) -> KVExport:
    got = await _fetched(peer, timeout_s, router)
    assert not got.stored
    return got.export


async def test_a_routed_handoff_returns_the_export(peer: Peer) -> None:
    got = await _fetch(peer)
    assert "store" not in peer.bodies[0]
    want = _export()
    assert all(torch.equal(a, b) for a, b in zip(got.blocks[0], want.blocks[0]))
    assert peer.routes == [
        {"model_fingerprint": "fp", "block_keys": ["00" * 16, "01" * 16], "num_tokens": len(PROMPT)}
    ]


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("altered", "checksum"), ("short", "truncated"), ("other_id", "request_id")],
)
async def test_a_spoiled_payload_is_rejected(peer: Peer, fault: str, reason: str) -> None:
    peer.fault = fault
    with pytest.raises(PayloadRejected) as info:
        await _fetch(peer)
    assert info.value.reason == reason


async def test_a_dropped_connection_is_a_connection_error(peer: Peer) -> None:
    peer.fault = "dropped"
    with pytest.raises(OSError):
        await _fetch(peer)


@pytest.mark.parametrize("fault", ["stale", "no_prefill"])
async def test_a_refusal_fails_the_handoff(peer: Peer, fault: str) -> None:
    peer.fault = fault
    with pytest.raises(HandoffFailed):
        await _fetch(peer)


async def test_a_frozen_prefill_node_times_out(peer: Peer) -> None:
    peer.fault = "frozen"
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await _fetch(peer, timeout_s=0.5)
    assert time.monotonic() - start < 2


async def test_no_router_listening_is_a_connection_error() -> None:
    from daemon.service.live_server import free_port

    async with aiohttp.ClientSession() as session:
        source = HttpKVSource(session, f"http://127.0.0.1:{free_port()}", "h1", "fp", 5.0)
        with pytest.raises(OSError):
            await source.fetch(PROMPT, [], END)


async def test_the_store_is_offered_and_blocks_left_there_come_back_named(peer: Peer) -> None:
    peer.fault = "stored"
    got = await _fetched(peer, store=OFFER)
    assert peer.bodies[0]["store"] == {"id": "store-a", "fingerprint": "ab" * 16, "block_size": 16}
    assert got.stored == [KEYS[0]] and got.export.start == 16
    assert all(torch.equal(a, b[1:]) for a, b in zip(got.export.blocks[0], _export().blocks[0]))
    with pytest.raises(PayloadRejected) as info:  # left there without the offer
        await _fetched(peer)
    assert info.value.reason == "range"
