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
