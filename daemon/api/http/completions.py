"""POST /v1/completions: OpenAI legacy completions, answered whole or streamed as SSE."""

from __future__ import annotations

from aiohttp import web

from daemon.api.http.cache_options import cache_options
from daemon.api.http.respond import respond
from daemon.api.http.state import get_state, read_json_object

routes = web.RouteTableDef()


@routes.post("/v1/completions")
async def create_completion(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    body = await read_json_object(request)
    codec = state.codecs.completions
    parsed = codec.parse(body)
    state.check_model(parsed.model)
    state.check_engine()
    cache = cache_options(request, body, state.engine)
    call = await codec.decode(parsed)
    state.check_capacity()
    return await respond(request, state.engine, call, cache)


def register(app: web.Application) -> None:
    app.router.add_routes(routes)
