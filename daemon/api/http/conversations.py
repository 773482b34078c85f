"""POST /v1/chat/completions, /v1/responses and /v1/messages: through deepseek-recipe for the
DeepSeek family, through the checkpoint's chat template (chat only) for the others."""

from __future__ import annotations

from aiohttp import web

from daemon.api.http.cache_options import cache_options
from daemon.api.http.errors import bad_request
from daemon.api.http.respond import respond
from daemon.api.http.state import get_state, read_json_object


async def handle(request: web.Request, protocol: str) -> web.StreamResponse:
    """`protocol`: chat, responses or messages (the codecs' names)."""
    state = get_state(request)
    body = await read_json_object(request)
    state.check_body_model(body)
    state.check_engine()
    codec = state.codecs.conversations.get(protocol)
    if codec is None:
        raise bad_request(f"{request.path} is not available for this model (it has no chat codec)")
    call = await codec.decode(body)
    state.check_capacity()
    cache = cache_options(request, body, state.engine)
    return await respond(request, state.engine, call, cache)


routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, "chat")


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    return await handle(request, "responses")


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    return await handle(request, "messages")


def register(app: web.Application) -> None:
    app.router.add_routes(routes)
