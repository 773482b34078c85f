"""GET /v1/models, /v1/models/{model} and /health."""

from __future__ import annotations

import orjson
from aiohttp import web

from daemon.api.http.errors import unavailable
from daemon.api.http.state import ApiState, get_state

routes = web.RouteTableDef()

DEMO_DESCRIPTION = "random-weight demo model; output is noise"


def model_card(state: ApiState) -> dict:
    card = {
        "id": state.served_name,
        "object": "model",
        "created": state.created,
        "owned_by": "deepinfer",
        "root": state.served_name,
        "parent": None,
        "max_model_len": state.engine.max_model_len,
        "deepinfer_demo": state.demo,
    }
    if state.demo:
        card["description"] = DEMO_DESCRIPTION
    return card


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [model_card(get_state(request))]})


@routes.get("/v1/models/{model:.+}")
async def retrieve_model(request: web.Request) -> web.Response:
    state = get_state(request)
    state.check_model(request.match_info["model"])
    return _json(model_card(state))


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """200 `ok` while serving; 503 while draining (SIGTERM or the admin socket's drain), so
    that load balancers send new requests elsewhere, and once the engine has failed."""
    state = get_state(request)
    engine = state.engine
    if engine.error is not None:
        raise unavailable(f"the inference engine has failed: {type(engine.error).__name__}")
    if state.draining:
        return _json({"status": "draining"} | engine.stats(), 503)
    return _json({"status": "ok"} | engine.stats())


def register(app: web.Application) -> None:
    app.router.add_routes(routes)
