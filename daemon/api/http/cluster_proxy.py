"""The router's proxy of the four generation APIs: a serving node (decode or unified) picked for
the request's model, the body sent on with the handoff headers, its answer relayed back byte for
byte. A node that fails before anything reached the client is retried once elsewhere; one that
fails after ends the stream with the protocol's error event; a client gone closes the upstream
at once."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import orjson
import structlog
from aiohttp import web

from daemon.api.http.cluster_state import ROUTER, RouterState
from daemon.api.http.errors import (
    ApiError,
    anthropic_error_body,
    bad_request,
    error_type,
    is_anthropic,
    model_not_found,
    unavailable,
)
from daemon.api.http.state import read_json_object
from daemon.cluster.node import NodeInfo
from daemon.cluster.stream_timing import StreamTiming

log = structlog.get_logger(__name__)

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
ROUTER_HEADER = "x-deepinfer-router"
HANDOFF_HEADER = "x-deepinfer-handoff-id"
_FORWARDED = (
    "Authorization", "x-api-key", "anthropic-version", "anthropic-beta", "Content-Type",
    "Accept", "X-Traffic-Class", "X-Request-Id",
)  # fmt: skip
_RETURNED = ("Content-Type", "Cache-Control", "X-Accel-Buffering", "Retry-After", "X-Request-Id")


class NodeLost(Exception):
    """The node stayed out of the peer set (dead, frozen, cut off) past the grace while the
    router waited on it."""


CONNECT_TIMEOUT_S = 5.0
POLL_S = 0.5  # how often a wait on a node checks that its lease still holds
MAX_WHOLE_BYTES = 256 << 20
_T = TypeVar("_T")
_NODE_ERRORS = (aiohttp.ClientError, TimeoutError, OSError, NodeLost)


@dataclass
class _Failed:
    """An attempt that sent nothing to the client: what to answer if no retry does better."""

    reason: str
    status: int = 503
    body: bytes | None = None  # the node's own error answer, in the protocol's shape
    headers: dict[str, str] | None = None


async def proxy(request: web.Request) -> web.StreamResponse:
    state = request.app[ROUTER]
    started = time.monotonic()
    body = await read_json_object(request)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    raw = await request.read()
    state.metrics.requests.labels(request.path).inc()
    if not state.router.serving_nodes(model) and not await _node_back(state, model):
        raise _no_node(state, model)
    failed: _Failed | None = None
    tried: set[str] = set()
    for attempt in range(2):
        node = state.router.pick_node(model, tried)
        if node is None:
            break
        if attempt:
            state.metrics.retries.inc()
        tried.add(node.node_id)
        state.router.in_flight[node.node_id] += 1
        try:
            result = await _attempt(request, state, node, raw, started)
        finally:
            state.router.in_flight[node.node_id] -= 1
        if not isinstance(result, _Failed):
            return result
        failed = result
        state.metrics.failures.labels(result.reason).inc()
        if result.reason == "connect":  # refused: no process listens (a starved one would)
            state.router.peers.remove(node.node_id)  # registers again if it is there after all
        log.warning(
            "serving_node_failed", node=node.node_id, reason=result.reason, retry=not attempt
        )
    if failed is not None and failed.body is not None:
        return web.Response(status=failed.status, body=failed.body, headers=failed.headers)
    raise unavailable("no node could take the request; retry later", 1)


async def _node_back(state: RouterState, model: str) -> bool:
    """With no live node of `model` but one whose lease lapsed lately (a starved node misses
    heartbeats and comes back), waits for a node of `model` to register, until that one has
    been gone `lost_grace_s`."""
    peers, grace = state.router.peers, state.lost_grace_s
    while any(n.served_model == model for n in peers.lapsed_since(grace)):
        await asyncio.sleep(POLL_S)
        if state.router.serving_nodes(model):
            return True
    return False


def _no_node(state: RouterState, model: str) -> ApiError:
    if model in state.router.served_models() or not state.router.serving():
        return unavailable(f"no node serving `{model}` is available; retry later", 1)
    return model_not_found(model)


async def _attempt(
    request: web.Request, state: RouterState, node: NodeInfo, raw: bytes, started: float
) -> web.StreamResponse | _Failed:
    headers = {k: v for k in _FORWARDED if (v := request.headers.get(k)) is not None}
    headers |= {ROUTER_HEADER: state.url, HANDOFF_HEADER: uuid.uuid4().hex}
    timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S)
    post = state.session.post(node.url + request.path, data=raw, headers=headers, timeout=timeout)
    try:
        upstream = await _while_live(state, node, post)
    except _NODE_ERRORS as e:
        return _Failed(_reason(e))
    try:
        returned = {k: v for k in _RETURNED if (v := upstream.headers.get(k)) is not None}
        if upstream.content_type != "text/event-stream":
            try:
                body = await _read_whole(state, node, upstream)
            except _NODE_ERRORS as e:
                return _Failed(_reason(e))
            if upstream.status >= 500:
                return _Failed(f"status_{upstream.status}", upstream.status, body, returned)
            return web.Response(status=upstream.status, body=body, headers=returned)
        timing = StreamTiming(request.path, started)
        return await _relay_stream(request, state, node, upstream, returned, timing)
    finally:
        if upstream.content.at_eof():
            upstream.release()
        else:  # a client gone (this task cancelled) or a failure: the node sees it closed
            upstream.close()


async def _read_whole(
    state: RouterState, node: NodeInfo, upstream: aiohttp.ClientResponse
) -> bytes:
    parts, size = [], 0
    while chunk := await _while_live(state, node, upstream.content.readany()):
        size += len(chunk)
        if size > MAX_WHOLE_BYTES:
            raise aiohttp.ClientPayloadError("the node's answer is too large")
        parts.append(chunk)
    return b"".join(parts)


async def _relay_stream(
    request: web.Request,
    state: RouterState,
    node: NodeInfo,
    upstream: aiohttp.ClientResponse,
    returned: dict[str, str],
    timing: StreamTiming,
) -> web.StreamResponse | _Failed:
    """Whole events only (up to a blank line), so that an error event never lands inside one.
    A failed write (the client gone) raises; a failed read (the node) ends with an error event.
    A stream relayed to its end has its TTFT and TPOT noted (the autoscaler's inputs)."""
    try:
        chunk = await _while_live(state, node, upstream.content.readany())
    except _NODE_ERRORS as e:
        return _Failed(_reason(e))
    response = web.StreamResponse(status=upstream.status, headers=returned)
    await response.prepare(request)
    pending = b""
    while chunk:
        pending += chunk
        cut = pending.rfind(b"\n\n") + 2
        if cut > 1:
            timing.feed(pending[:cut], time.monotonic())
            await response.write(pending[:cut])
            pending = pending[cut:]
        try:
            chunk = await _while_live(state, node, upstream.content.readany())
        except _NODE_ERRORS as e:
            return await _broken(request, state, node, response, _reason(e))
    if pending:
        return await _broken(request, state, node, response, "partial_event")
    await response.write_eof()
    ttft = timing.ttft_s()
    if ttft is not None:
        state.slo.add(time.monotonic(), ttft, timing.tpot_s())
    return response


async def _broken(
    request: web.Request,
    state: RouterState,
    node: NodeInfo,
    response: web.StreamResponse,
    reason: str,
) -> web.StreamResponse:
    state.metrics.failures.labels(f"stream_{reason}").inc()
    log.warning("serving_node_failed_mid_stream", node=node.node_id, reason=reason)
    await response.write(_error_event(request))
    await response.write_eof()
    return response


def _error_event(request: web.Request) -> bytes:
    message = "the serving node failed while streaming this answer; retry the request"
    if is_anthropic(request):
        data = anthropic_error_body(503, message)
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"
    data = {"error": {"message": message, "type": error_type(503), "param": None, "code": None}}
    if request.path == "/v1/responses":
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"
    return b"data: " + orjson.dumps(data) + b"\n\ndata: [DONE]\n\n"


async def _while_live(state: RouterState, node: NodeInfo, aw: Awaitable[_T]) -> _T:
    """`aw`, cancelled (NodeLost) once the node has been out of the peer set (its lease lapsed,
    or another process holds its id) for `state.lost_grace_s` on end; polled every POLL_S.
    A lapsed lease alone fails nothing: a starved node misses heartbeats while it still
    computes, and registers again once it catches up (it gets no new requests meanwhile). Each
    call is one read, so the grace starts over with every chunk the node sends."""
    task = asyncio.ensure_future(aw)
    gone_since: float | None = None
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            live = state.router.peers.get(node.node_id)
            if live is not None and live.epoch == node.epoch:
                gone_since = None
                continue
            now = time.monotonic()
            if gone_since is None:
                gone_since = now
                log.info("serving_node_lapsed", node=node.node_id, grace_s=state.lost_grace_s)
            if now - gone_since >= state.lost_grace_s:
                raise NodeLost(node.node_id)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _reason(e: BaseException) -> str:
    if isinstance(e, NodeLost):
        return "node_lost"
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "connect"
    return "connection"
