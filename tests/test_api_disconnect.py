"""A client that goes away mid-request gets its engine requests aborted and KV freed."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import TINY_SERVED_NAME

MAX_TOKENS = 1000  # would run for many seconds if nothing aborted it
LONG = {"model": TINY_SERVED_NAME, "prompt": "Go on", "max_tokens": MAX_TOKENS, "ignore_eos": True}


async def _steps(api_server) -> int:
    async with aiohttp.ClientSession() as s, s.get(api_server.url + "/health") as r:
        return (await r.json())["steps"]


def _assert_aborted(stats: dict, steps_before: int) -> None:
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["steps"] - steps_before < MAX_TOKENS // 2, stats  # stopped early, not finished


@pytest.mark.parametrize("n", [1, 2])
async def test_stream_disconnect_aborts(api_server, wait_idle, n: int) -> None:
    before = await _steps(api_server)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            api_server.base_url + "/completions", json=LONG | {"stream": True, "n": n}
        )
        assert resp.status == 200
        events = 0
        async for line in resp.content:
            events += line.startswith(b"data: ")
            if events == 3:
                break
        resp.close()  # drop the connection mid-stream
    _assert_aborted(await wait_idle(timeout=5), before)


async def test_whole_request_client_timeout_aborts(api_server, wait_idle) -> None:
    before = await _steps(api_server)
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                api_server.base_url + "/completions", json=LONG | {"n": 2}
            ) as r:
                await r.read()
    _assert_aborted(await wait_idle(timeout=5), before)


async def test_server_still_serves_after_disconnects(api_server) -> None:
    body = {"model": TINY_SERVED_NAME, "prompt": "ok", "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(api_server.base_url + "/completions", json=body) as r,
    ):
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] >= 1


async def test_every_disconnected_request_gets_its_access_log_line(api_server, wait_idle) -> None:
    """As nginx logs it: status 499 for a request whose client closed first, streamed or not."""
    import time
    import uuid

    from structlog.testing import capture_logs

    async def whole(rid: str) -> None:
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(
                    api_server.base_url + "/completions", json=LONG, headers={"X-Request-Id": rid}
                ) as r:
                    await r.read()

    async def streamed(rid: str) -> None:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                api_server.base_url + "/completions",
                json=LONG | {"stream": True},
                headers={"X-Request-Id": rid},
            )
            await resp.content.readline()
            resp.close()

    ids = {
        f"gone-{kind}-{i}-{uuid.uuid4().hex[:6]}": kind
        for kind in ("whole", "stream")
        for i in range(4)
    }
    with capture_logs() as logs:
        await asyncio.gather(
            *((whole if k == "whole" else streamed)(rid) for rid, k in ids.items())
        )
        await wait_idle(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            lines = {e["request_id"]: e for e in logs if e["event"] == "request"}
            if set(ids) <= set(lines):
                break
            await asyncio.sleep(0.05)
    missing = set(ids) - set(lines)
    assert not missing, f"no request line for {sorted(missing)}"
    assert {lines[rid]["status"] for rid in ids} == {499}
    assert all(lines[rid]["path"] == "/v1/completions" for rid in ids)


async def test_requests_cut_by_the_shutdown_log_503(tiny_model_dir) -> None:
    """Past the shutdown's grace time the server closes the connections and cancels what
    still runs: our doing, so 503 in the access log, not 499 (the client did not go away)."""
    import contextlib
    import time
    import uuid

    from structlog.testing import capture_logs

    from daemon.api.http.config import ServerConfig
    from daemon.build.config import EngineConfig
    from daemon.service.live_server import LiveServer
    from tests.conftest import TINY_MAX_MODEL_LEN

    engine_cfg = EngineConfig(
        model=str(tiny_model_dir), served_model_name=TINY_SERVED_NAME, kv_cache_memory_gb=0.05,
        max_model_len=TINY_MAX_MODEL_LEN,
    )  # fmt: skip
    server = LiveServer(engine_cfg, ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=0.3))
    server.start()
    ids = {f"cut-{kind}-{uuid.uuid4().hex[:6]}": kind for kind in ("whole", "stream")}

    async def request(session: aiohttp.ClientSession, rid: str, started: asyncio.Event) -> None:
        body = LONG | {"stream": ids[rid] == "stream"}
        with contextlib.suppress(aiohttp.ClientError):
            async with session.post(
                server.base_url + "/completions", json=body, headers={"X-Request-Id": rid}
            ) as r:
                started.set()
                await r.read()

    with capture_logs() as logs:
        async with aiohttp.ClientSession() as session:
            started = {rid: asyncio.Event() for rid in ids}
            tasks = [asyncio.create_task(request(session, rid, started[rid])) for rid in ids]
            await asyncio.wait_for(started[next(r for r in ids if ids[r] == "stream")].wait(), 30)
            deadline = time.monotonic() + 30
            while True:  # both are running in the engine
                async with session.get(server.url + "/health") as r:
                    if (await r.json())["running"] == 2:
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await asyncio.to_thread(server.stop)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
    lines = {e["request_id"]: e for e in logs if e["event"] == "request"}
    assert {rid: lines[rid]["status"] for rid in ids} == dict.fromkeys(ids, 503)
