"""The router's aiohttp app (`--role router`, no model): the four generation APIs by proxy to a
decode node, `/v1/models` of the live nodes, `/health`, `/metrics`, the prefill choice for
handoffs (`POST /cluster/v1/route/prefill`) and the registration routes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from daemon.api.http.access import echo_request_id, request_id_middleware
from daemon.api.http.auth import key_matches
from daemon.api.http.cluster_proxy import PATHS, proxy
from daemon.api.http.cluster_state import ROUTER, RouterState
from daemon.api.http.errors import (
    Handler,
    bad_request,
    counting_errors,
    model_not_found,
    unauthorized,
    unavailable,
)
from daemon.api.http.metrics import HttpErrors
from daemon.api.http.state import read_json_object

OPEN_PATHS = ("/health",)
MAX_BLOCK_KEYS = 1 << 16
KEY_HEX = 32  # blake2b-128

routes = web.RouteTableDef()


def create_router_app(
    state: RouterState,
    max_body_bytes: int,
    add_registration: Callable[[web.Application], None] | None = None,
) -> web.Application:
    """`add_registration` adds the nodes' registration routes (cluster discovery's)."""
    app = web.Application(
        client_max_size=max_body_bytes,
        middlewares=[
            request_id_middleware,
            counting_errors(HttpErrors(state.metrics.registry)),
            _auth_middleware,
        ],
    )
    app[ROUTER] = state
    app.router.add_routes(routes)
    for path in PATHS:
        app.router.add_post(path, proxy)
    if add_registration is not None:
        add_registration(app)
    app.on_response_prepare.append(echo_request_id)
    app.on_startup.append(_open_session)
    app.on_cleanup.append(_close_session)
    return app


async def _open_session(app: web.Application) -> None:
    # no pool limit per host: every proxied stream holds a connection for its whole answer
    app[ROUTER].session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def _close_session(app: web.Application) -> None:
    await app[ROUTER].session.close()


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[ROUTER].api_key
    if key and request.path not in OPEN_PATHS and not key_matches(request, key):
        raise unauthorized()
    return await handler(request)


def _card(state: RouterState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "deepinfer"}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state = request.app[ROUTER]
    return _json({"object": "list", "data": [_card(state, m) for m in state.router.models()]})


@routes.get("/v1/models/{model:.+}")
async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[ROUTER]
    name = request.match_info["model"]
    if name not in state.router.models():
        raise model_not_found(name)
    return _json(_card(state, name))


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """200 while serving, with the live nodes by role."""
    state = request.app[ROUTER]
    live = state.router.peers.live()
    roles = Counter(n.role for n in live)
    return _json(
        {
            "status": "ok",
            "role": "router",
            "nodes": {role: roles.get(role, 0) for role in ("prefill", "decode", "unified")},
            "in_flight": sum(state.router.in_flight.values()),
            "prefill_balance": {"rel": state.router.balance.rel, "abs": state.router.balance.abs},
        }
    )


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ROUTER].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@routes.post("/cluster/v1/route/prefill")
async def route_prefill(request: web.Request) -> web.Response:
    """{"model_fingerprint", "block_keys": [hex], "num_tokens"} -> the prefill node to ask:
    {"node_id", "url", "epoch", "lease_ms", "matched_blocks"}; 503 when none is live."""
    state = request.app[ROUTER]
    body = await read_json_object(request)
    fingerprint = body.get("model_fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise bad_request("'model_fingerprint' must be a non-empty string", "model_fingerprint")
    keys = _keys(body.get("block_keys"))
    route = state.router.pick_prefill(fingerprint, keys)
    if route is None:
        raise unavailable("no prefill node of this model is live", 1)
    state.metrics.prefill_routes.labels("hit" if route.matched_blocks else "miss").inc()
    node = route.node
    return _json(
        {
            "node_id": node.node_id,
            "url": node.url,
            "epoch": node.epoch,
            "lease_ms": state.lease_ms,
            "matched_blocks": route.matched_blocks,
        }
    )


def _keys(raw: object) -> list[bytes]:
    if not isinstance(raw, list) or len(raw) > MAX_BLOCK_KEYS:
        raise bad_request(f"'block_keys' must be a list of at most {MAX_BLOCK_KEYS}", "block_keys")
    try:
        keys = [bytes.fromhex(k) for k in raw if isinstance(k, str) and len(k) == KEY_HEX]
    except ValueError:
        keys = []
    if len(keys) != len(raw):
        raise bad_request(f"'block_keys' must be {KEY_HEX}-digit hex strings", "block_keys")
    return keys


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
