"""The aiohttp application, its startup/shutdown with the engine, and the serving entry points."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from types import ModuleType

import structlog
import uvloop
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from daemon.api import completions, conversations, models, tokenize
from daemon.api.auth import auth_middleware
from daemon.api.chat_template import ChatTemplate
from daemon.api.constraints import Constraints
from daemon.api.errors import error_middleware
from daemon.api.state import STATE, ApiState
from daemon.build import build_engine
from daemon.config import EngineConfig, ServerConfig
from daemon.demo import DEMO_NAME, is_demo
from daemon.loop.engine import Engine
from daemon.models.loader import read_config
from daemon.recipe.codec import RecipeCodec

log = structlog.get_logger(__name__)

# Each endpoint module exposes register(app).
ENDPOINTS: tuple[ModuleType, ...] = (models, completions, conversations, tokenize)


def create_app(
    engine: Engine,
    served_name: str,
    server_cfg: ServerConfig,
    *,
    demo: bool | None = None,
    model_dir: Path | None = None,
) -> web.Application:
    """`model_dir` (the checkpoint) supplies the chat template of non-DeepSeek families."""
    codec = _codec(engine, served_name)
    app = web.Application(
        client_max_size=server_cfg.max_body_bytes, middlewares=[error_middleware, auth_middleware]
    )
    app[STATE] = ApiState(
        engine,
        served_name,
        served_name == DEMO_NAME if demo is None else demo,
        int(time.time()),
        codec=codec,
        chat_template=_chat_template(engine, model_dir) if codec is None else None,
        constraints=_constraints(engine),
        max_waiting=server_cfg.max_waiting,
        api_key=server_cfg.api_key,
    )
    for endpoint in ENDPOINTS:
        endpoint.register(app)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


def _codec(engine: Engine, served_name: str) -> RecipeCodec | None:
    """DeepSeek-V4 checkpoints with a tokenizer speak through deepseek-recipe."""
    if engine.tokenizer is None or not is_deepseek_v4(engine.runner.model):
        return None
    return RecipeCodec(engine.tokenizer, served_name, engine.max_model_len)


def _constraints(engine: Engine) -> Constraints | None:
    if engine.tokenizer is None:
        return None
    return Constraints(engine.tokenizer, engine.runner.vocab_size, engine.eos_token_ids)


def _chat_template(engine: Engine, model_dir: Path | None) -> ChatTemplate | None:
    if engine.tokenizer is None or model_dir is None:
        return None
    return ChatTemplate.load(model_dir, engine.tokenizer)


def is_deepseek_v4(model: object) -> bool:
    return type(model).__module__.startswith("daemon.models.deepseek_v4")


async def _start_engine(app: web.Application) -> None:
    await app[STATE].engine.start()


async def _stop_engine(app: web.Application) -> None:
    await app[STATE].engine.stop()
    if app[STATE].constraints is not None:
        app[STATE].constraints.close()


class AccessLogger(AbstractAccessLogger):
    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        emit = log.debug if request.path == "/health" else log.info
        emit(
            "http",
            method=request.method,
            path=request.path,
            status=response.status,
            ms=round(time * 1000, 1),
            remote=request.remote,
        )


async def start_server(app: web.Application, server_cfg: ServerConfig) -> web.AppRunner:
    """Starts serving `app` on host:port (port 0 = any free one; see `bound_port`)."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log_class=AccessLogger,
        shutdown_timeout=server_cfg.shutdown_timeout,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, server_cfg.host, server_cfg.port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


async def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> None:
    """Builds the engine, serves until SIGINT/SIGTERM, then shuts down gracefully."""
    engine, name = build_engine(engine_cfg)
    demo = engine_cfg.model is None or is_demo(read_config(Path(engine_cfg.model)))
    model_dir = Path(engine_cfg.model) if engine_cfg.model else None
    app = create_app(engine, name, server_cfg, demo=demo, model_dir=model_dir)
    runner = await start_server(app, server_cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "serving",
        url=f"http://{server_cfg.host}:{bound_port(runner)}/v1",
        model=name,
        random_weight_demo=demo,
    )
    try:
        await stop.wait()
        log.info("shutting_down", grace_s=server_cfg.shutdown_timeout)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    log.info("stopped")


def run_server(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> None:
    uvloop.run(serve(engine_cfg, server_cfg))
