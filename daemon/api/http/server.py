"""The aiohttp application, its startup/shutdown with the engine, and the serving entry points."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import ModuleType

import structlog
from aiohttp import web

from daemon.api.codecs.base import Codec, JsonObject
from daemon.api.codecs.chat_template import ChatTemplate
from daemon.api.codecs.completions import CompletionsCodec
from daemon.api.codecs.constraints import Constraints
from daemon.api.codecs.dense_chat import DenseChatCodec
from daemon.api.codecs.dense_conversation import DenseConversationCodec
from daemon.api.codecs.images import ImageLimits, ImageReader
from daemon.api.codecs.recipe.codec import CHAT, MESSAGES, RESPONSES, RecipeCodec
from daemon.api.codecs.recipe.conversation import ConversationCodec
from daemon.api.codecs.response_store import ResponseStore
from daemon.api.http import (
    admin_http,
    cluster_encode,
    cluster_handoff,
    completions,
    conversations,
    metrics,
    models,
    stored_responses,
    tokenize,
)
from daemon.api.http import metrics as metrics_route
from daemon.api.http.access import AccessLogger, echo_request_id, request_id_middleware
from daemon.api.http.auth import auth_middleware
from daemon.api.http.cluster_handoff import HandoffConfig
from daemon.api.http.config import ServerConfig
from daemon.api.http.errors import counting_errors
from daemon.api.http.state import STATE, ApiState, Codecs
from daemon.build.demo import DEMO_NAME
from daemon.build.startup import failing_as
from daemon.cluster.live_role import RoleChanger
from daemon.loop.engine import Engine
from daemon.loop.metrics import EngineMetrics
from daemon.models.base import VisionLanguageModel

log = structlog.get_logger(__name__)


# Each endpoint module exposes register(app).
ENDPOINTS: tuple[ModuleType, ...] = (
    models,
    completions,
    conversations,
    stored_responses,
    tokenize,
    metrics,
)


def create_app(
    engine: Engine,
    served_name: str,
    server_cfg: ServerConfig,
    *,
    metrics: EngineMetrics,
    demo: bool | None = None,
    model_dir: Path | None = None,
    handoff: HandoffConfig | None = None,
    role_change: RoleChanger | None = None,
    image_encoder: bool = False,
) -> web.Application:
    """`metrics`: the engine's request observer (what /metrics serves); `model_dir` (the
    checkpoint) supplies the chat template of non-DeepSeek families; `handoff`: a prefill or
    decode node's part in KV handoffs; `role_change`: its live role change (the admin HTTP
    call's, served when `server_cfg.admin_token` is set); `image_encoder`: serve image
    embeddings to other nodes (`--role encoder`)."""
    store = ResponseStore(
        server_cfg.response_store_max_count,
        int(server_cfg.response_store_memory_gb * 2**30),
        server_cfg.response_store_ttl_s,
    )
    app = web.Application(
        client_max_size=server_cfg.max_body_bytes,
        middlewares=[
            request_id_middleware,
            counting_errors(metrics_route.HttpErrors(metrics.registry)),
            auth_middleware,
        ],
    )
    app[STATE] = ApiState(
        engine,
        served_name,
        served_name == DEMO_NAME if demo is None else demo,
        int(time.time()),
        _codecs(engine, served_name, server_cfg, model_dir, store),
        max_waiting=server_cfg.max_waiting,
        api_key=server_cfg.api_key,
        metrics=metrics,
    )
    if (reader := app[STATE].codecs.images) is not None:
        metrics_route.ImagesPreprocessed(reader, metrics.registry)
    app[stored_responses.RESPONSE_STORE] = store
    for endpoint in ENDPOINTS:
        endpoint.register(app)
    if handoff is not None:
        cluster_handoff.register(app, handoff)
    if server_cfg.admin_token:
        admin_http.register(app, server_cfg.admin_token, role_change)
    if image_encoder:
        cluster_encode.register(app)
    app.on_response_prepare.append(echo_request_id)
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_stopping)
    app.on_cleanup.append(_stop_engine)
    return app


def _codecs(
    engine: Engine,
    served_name: str,
    server_cfg: ServerConfig,
    model_dir: Path | None,
    store: ResponseStore,
) -> Codecs:
    """DeepSeek-V4 checkpoints with a tokenizer speak through deepseek-recipe; other families'
    conversations go through the checkpoint's chat template, where it has one (Responses and
    Messages converted by the recipe, answered by its stream processor)."""
    tok = engine.tokenizer
    completions = CompletionsCodec(tok, served_name)
    images = _image_reader(engine, server_cfg, model_dir)
    if tok is None:
        return Codecs(completions, images=images)
    constraints = Constraints(tok, engine.runner.vocab_size, engine.eos_token_ids)
    if is_deepseek_v4(engine.runner.model):
        recipe = RecipeCodec(tok, served_name, engine.max_model_len, server_cfg.thinking_default)
        conversations = {
            p.name: ConversationCodec(recipe, p, constraints, engine.eos_token_ids, store)
            for p in (CHAT, RESPONSES, MESSAGES)
        }
        return Codecs(completions, conversations, recipe=recipe, constraints=constraints)
    template = (
        ChatTemplate.load(model_dir, tok, server_cfg.tool_call_parser)
        if model_dir is not None
        else None
    )
    if template is None:
        return Codecs(completions, constraints=constraints, images=images)
    chat = DenseChatCodec(template, constraints, served_name, engine.max_model_len, images)
    conversations: dict[str, Codec[JsonObject]] = {CHAT.name: chat}
    for p in (RESPONSES, MESSAGES):
        conversations[p.name] = DenseConversationCodec(chat, p, engine.eos_token_ids, store)
    return Codecs(
        completions, conversations, chat_template=template, constraints=constraints, images=images
    )


def image_limits(cfg: ServerConfig) -> ImageLimits:
    return ImageLimits(
        max_images=cfg.image_max_count,
        max_bytes=cfg.image_max_bytes,
        max_total_bytes=cfg.image_max_total_bytes,
        max_pixels=cfg.image_max_pixels,
        schemes=tuple(s.strip() for s in cfg.image_url_schemes.split(",") if s.strip()),
        fetch_timeout_s=cfg.image_fetch_timeout_s,
    )


def _image_reader(engine: Engine, cfg: ServerConfig, model_dir: Path | None) -> ImageReader | None:
    """A vision model's image reader (its checkpoint's image processor); None for others."""
    model = engine.runner.model
    if model_dir is None or engine.images is None or not isinstance(model, VisionLanguageModel):
        return None
    return ImageReader.load(model_dir, image_limits(cfg), model.image_token_id, model.image_tokens)


def is_deepseek_v4(model: object) -> bool:
    return type(model).__module__.startswith("daemon.models.deepseek_v4")


async def _start_engine(app: web.Application) -> None:
    await app[STATE].engine.start()


async def _stopping(app: web.Application) -> None:
    """Before the server's grace time for running handlers: those it cancels after are ours."""
    app[STATE].stopping = True


async def _stop_engine(app: web.Application) -> None:
    await app[STATE].engine.stop()
    if app[STATE].codecs.constraints is not None:
        app[STATE].codecs.constraints.close()


def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of host:port (as aiohttp's TCPSite binds them), not yet
    listening: connections are refused until the server starts on them. StartupError when an
    address is taken or not this host's."""
    socks: list[socket.socket] = []
    with failing_as(f"cannot listen on {host}:{port}", OSError):
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # as asyncio does: "::" is not also 0.0.0.0
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
        except BaseException:
            for sock in socks:
                sock.close()
            raise
    return socks


async def start_server(
    app: web.Application, server_cfg: ServerConfig, socks: list[socket.socket] | None = None
) -> web.AppRunner:
    """Starts serving `app` on `socks` (from `bind_tcp`), or else on host:port (port 0 = any
    free one; see `bound_port`)."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log_class=AccessLogger,
        shutdown_timeout=server_cfg.shutdown_timeout,
    )
    await runner.setup()
    try:
        if socks is not None:
            # two daemons can both bind a port (SO_REUSEADDR) while neither listens yet
            with failing_as(f"cannot listen on {server_cfg.host}:{server_cfg.port}", OSError):
                for sock in socks:
                    await web.SockSite(runner, sock).start()
        else:
            await web.TCPSite(runner, server_cfg.host, server_cfg.port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]
