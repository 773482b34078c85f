"""Shared fixtures: tiny random-weight Llama and DeepSeek-V4 checkpoints, and live API servers
serving them in-process (daemon.service.live_server: any event loop or none on the test's side)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.models.checkpoints import copy_tokenizer, make_dense_checkpoint, make_v4_checkpoint
from daemon.service.live_server import LiveServer

TINY_MAX_MODEL_LEN = 1024
TINY_SERVED_NAME = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, hidden 64, 2 layers, 4 heads / 2 KV heads, the DeepSeek tokenizer (vocab 129280)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return make_dense_checkpoint(path, with_tokenizer=True, max_position_embeddings=2048)


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
def llava_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA (CLIP tower, projector, Llama) with the DeepSeek tokenizer and a
    plain chat template (tests/test_api_images.py)."""
    from tests.test_api_images import make_chat_llava

    return make_chat_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def v4_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DeepSeek-V4 (hidden 64, 3 layers) with the real V4 tokenizer (vocab 129280)."""
    return copy_tokenizer(make_v4_checkpoint(tmp_path_factory.mktemp("tiny-v4"), vocab_size=129280))


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
