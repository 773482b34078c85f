"""SIGTERM while 20 streams run: every stream finishes, new requests get 503 with
Retry-After, and the process exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import aiohttp
import orjson

from tests.daemons import daemon

MAX_TOKENS = 300


async def _stream(
    http: aiohttp.ClientSession, url: str, started: asyncio.Event, i: int
) -> str | None:
    body = {
        "model": "tiny", "prompt": list(range(100 + i, 140 + i)), "max_tokens": MAX_TOKENS,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    finish, chunks = None, 0
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunks += 1
            started.set()
            finish = orjson.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return finish


async def test_sigterm_drains_streams(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = [
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-memory-gb",
        "0.05", "--no-kv-store", "--shutdown-timeout", "120", "--log-format", "json",
    ]  # fmt: skip
    with daemon(args, tmp_path / "d.log") as (url, proc):
        async with aiohttp.ClientSession() as http:
            started = [asyncio.Event() for _ in range(20)]
            streams = [asyncio.create_task(_stream(http, url, started[i], i)) for i in range(20)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            body = {"model": "tiny", "prompt": "late", "max_tokens": 2}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 503 and r.headers["Retry-After"]
                assert "shutting down" in (await r.json())["error"]["message"]
            async with http.get(url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "draining"
            finishes = await asyncio.wait_for(asyncio.gather(*streams), 180)
        assert finishes == ["length"] * 20
        assert await asyncio.to_thread(proc.wait, 60) == 0
    log = (tmp_path / "d.log").read_text()
    assert '"event": "draining"' in log and '"event": "stopped"' in log


async def test_sighup_reloads_live_settings(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text("[server]\nmax_waiting = 0\n")
    args = [
        "--config", str(config), "--model", str(tiny_model_dir), "--served-model-name", "tiny",
        "--kv-cache-memory-gb", "0.02", "--no-kv-store", "--log-format", "json",
    ]  # fmt: skip
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}
    with daemon(args, tmp_path / "d.log") as (url, proc):
        async with aiohttp.ClientSession() as http:

            async def status(**headers: str) -> int:
                async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                    return r.status

            assert await status() == 200
            config.write_text('[server]\napi_key = "k2"\n[logging]\nlevel = "debug"\n')
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(1.0)
            assert await status() == 401 and await status(Authorization="Bearer k2") == 200
            config.write_text("[server]\nmax_waiting = -1\n")  # rejected: nothing changes
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(1.0)
            assert await status() == 401 and await status(Authorization="Bearer k2") == 200
            (tmp_path / "a-file").write_text("")
            unopenable = tmp_path / "a-file" / "d.log"  # rejected too, the API key with it
            config.write_text(f'[server]\napi_key = "k3"\n[logging]\nfile = "{unopenable}"\n')
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(1.0)
            assert await status(Authorization="Bearer k2") == 200
            assert proc.poll() is None
    log = (tmp_path / "d.log").read_text()
    assert '"event": "settings_reloaded"' in log
    rejected = [
        orjson.loads(line) for line in log.splitlines() if "settings_reload_rejected" in line
    ]
    assert "server.max_waiting" in rejected[0]["error"]
    assert rejected[1]["error"] == f"cannot open the log file {unopenable}: Not a directory"


MARKER = 511  # a prompt holding this token id makes the test's forward fail


async def test_a_failed_engine_exits_the_daemon_and_keeps_finished_work(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The engine loop fails (as on a device error): the request that was running gets an
    error, the block store keeps what finished requests wrote, and the daemon exits 4 so that
    systemd starts a fresh one, where it would otherwise answer 503 until someone restarts it."""
    from structlog.testing import capture_logs

    from daemon.api.http.config import ServerConfig
    from daemon.build.config import EngineConfig
    from daemon.loop.runner import ModelRunner
    from daemon.service.daemon import EXIT_ENGINE_FAILED, serve
    from daemon.service.settings import Settings
    from tests.daemons import free_port

    execute = ModelRunner.execute

    def failing(self, step, *args):
        if bool((step.input_ids == MARKER).any()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return execute(self, step, *args)

    monkeypatch.setattr(ModelRunner, "execute", failing)
    store = tmp_path / "store"
    port = free_port()
    settings = Settings(
        engine=EngineConfig(
            model=str(tiny_model_dir), kv_cache_memory_gb=0.02, kv_store_dir=str(store)
        ),
        server=ServerConfig(port=port),
    )
    url = f"http://127.0.0.1:{port}/v1/completions"
    with capture_logs() as logs:
        served = asyncio.create_task(serve(settings))
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.1)
            model = {"model": tiny_model_dir.name, "max_tokens": 4, "ignore_eos": True}
            async with http.post(url, json=model | {"prompt": list(range(2, 66))}) as r:
                assert r.status == 200
            async with http.post(url, json=model | {"prompt": [MARKER] * 8}) as r:
                assert r.status == 503
                assert "aborted" in (await r.json())["error"]["message"]
        assert await asyncio.wait_for(served, 60) == EXIT_ENGINE_FAILED
    events = [e["event"] for e in logs]
    assert "engine_loop_failed" in events and "engine_failed_exiting" in events
    assert events[-1] == "stopped"
    assert len(list(store.rglob("*.kvb"))) >= 4  # the finished prompt's 64 tokens, by 16
