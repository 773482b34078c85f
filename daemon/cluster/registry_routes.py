"""The registration routes a router (and any seed peer) serves over a PeerSet:
POST /cluster/v1/nodes (register), PUT /cluster/v1/nodes/{id} (heartbeat with load), DELETE
/cluster/v1/nodes/{id} (leave), GET /cluster/v1/nodes (the live ones). Errors are JSON in
OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import orjson
import structlog
from aiohttp import web

from daemon.cluster.config import NODE_ID
from daemon.cluster.node import ROLES, NodeInfo, NodeInfoError, counts
from daemon.cluster.peers import PeerSet

log = structlog.get_logger(__name__)

PEERS: web.AppKey[PeerSet] = web.AppKey("cluster_peers", PeerSet)
NODES = "/cluster/v1/nodes"
MIN_TTL_S, MAX_TTL_S = 1.0, 300.0


def add_registry_routes(app: web.Application, peers: PeerSet) -> None:
    """Serves the registration routes of `peers` on `app` (before it starts)."""
    app[PEERS] = peers
    app.router.add_post(NODES, register)
    app.router.add_get(NODES, list_nodes)
    app.router.add_put(NODES + "/{node_id}", heartbeat)
    app.router.add_delete(NODES + "/{node_id}", leave)


async def register(request: web.Request) -> web.Response:
    """Body: a NodeInfo's JSON plus `ttl_s`. 409 stale_epoch when a live entry of the same node
    id has a newer epoch (an old process of a node that restarted)."""
    body = await _body(request)
    if isinstance(body, web.Response):
        return body
    ttl = body.get("ttl_s")
    if not isinstance(ttl, int | float) or isinstance(ttl, bool):
        return _error(400, "ttl_s: must be a number of seconds", "ttl_s")
    if not MIN_TTL_S <= ttl <= MAX_TTL_S:
        return _error(400, f"ttl_s: must lie in [{MIN_TTL_S:g}, {MAX_TTL_S:g}]", "ttl_s")
    try:
        info = NodeInfo.from_json({k: v for k, v in body.items() if k != "ttl_s"})
    except NodeInfoError as e:
        return _error(400, str(e), str(e).split(":", 1)[0])
    if not NODE_ID.match(info.node_id):
        return _error(400, "node_id: letters, digits, '.', '_', '-' (at most 128)", "node_id")
    peers = request.app[PEERS]
    live = peers.get(info.node_id)
    if live is not None and info.epoch < live.epoch:
        return _stale(info.node_id, live.epoch)
    peers.upsert(info, float(ttl))
    if live is not None and live.epoch == info.epoch and live.role != info.role:
        log.info("node_role_changed", node_id=info.node_id, old=live.role, new=info.role)
    elif live is None or live.epoch != info.epoch:
        log.info(
            "node_registered",
            node_id=info.node_id,
            role=info.role,
            url=info.url,
            epoch=info.epoch,
            ttl_s=ttl,
        )
    return _json({"node_id": info.node_id, "epoch": info.epoch, "ttl_s": float(ttl)})


async def heartbeat(request: web.Request) -> web.Response:
    """Body: {"epoch", "load"}. 404 unknown_node: the node registers again (its lease lapsed,
    or this registry restarted); 409 stale_epoch: a newer process holds the node id."""
    node_id = request.match_info["node_id"]
    body = await _body(request)
    if isinstance(body, web.Response):
        return body
    epoch = body.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        return _error(400, "epoch: must be an integer", "epoch")
    try:
        load = counts(body.get("load", {}), "load")
    except NodeInfoError as e:
        return _error(400, str(e), "load")
    peers = request.app[PEERS]
    live = peers.get(node_id)
    if live is not None and epoch < live.epoch:
        return _stale(node_id, live.epoch)
    if live is None or epoch > live.epoch or not peers.renew(node_id, load):
        return _error(404, f"node {node_id!r} is not registered here", code="unknown_node")
    return _json({"node_id": node_id, "expires_in_s": peers.expires_in(node_id)})


async def leave(request: web.Request) -> web.Response:
    """`?epoch=N`: only that process's entry goes (a newer one of the same id stays)."""
    node_id = request.match_info["node_id"]
    peers = request.app[PEERS]
    live = peers.get(node_id)
    given = request.query.get("epoch")
    if given is not None and not given.isdigit():
        return _error(400, "epoch: must be a non-negative integer", "epoch")
    removed = live is not None and (given is None or int(given) == live.epoch)
    if removed:
        peers.remove(node_id)
        log.info("node_left", node_id=node_id, epoch=live.epoch)
    return _json({"node_id": node_id, "removed": removed})


async def list_nodes(request: web.Request) -> web.Response:
    """`?role=` and `?fingerprint=` filter."""
    role = request.query.get("role")
    if role is not None and role not in ROLES:
        return _error(400, f"role: {role!r} is not one of {', '.join(ROLES)}", "role")
    peers = request.app[PEERS]
    nodes = peers.live(role, request.query.get("fingerprint"))  # type: ignore[arg-type]
    data = [n.to_json() | {"expires_in_s": peers.expires_in(n.node_id)} for n in nodes]
    return _json({"object": "list", "data": data})


async def _body(request: web.Request) -> dict[str, Any] | web.Response:
    """The JSON object sent, or the error to answer."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "the body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


def _stale(node_id: str, epoch: int) -> web.Response:
    return _error(
        409,
        f"node {node_id!r} is registered by a newer process (epoch {epoch})",
        "epoch",
        code="stale_epoch",
    )


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return _json({"error": error}, status)
