"""Request ids and the access log: every request gets an id (the client's X-Request-Id or a
new one) bound to its log lines and echoed back; generation handlers note what the request
did, and one `request` line per request carries it with the status and duration (499, as
nginx logs it, for one whose client went away before its answer was done; 503 for one the
shutdown cut past its grace time)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from daemon.api.http.state import STATE
from daemon.loop.request import Request

log = structlog.get_logger(__name__)
HEADER = "X-Request-Id"
REQUEST_ID = web.RequestKey("deepinfer_request_id", str)
_NOTES = web.RequestKey("deepinfer_access", dict)
CLIENT_CLOSED = 499  # nginx's status for a request its client closed first


@web.middleware
async def request_id_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    rid = request.headers.get(HEADER, "")[:128] or uuid.uuid4().hex
    request[REQUEST_ID] = rid
    start = time.monotonic()
    with structlog.contextvars.bound_contextvars(request_id=rid):
        try:
            return await handler(request)
        except asyncio.CancelledError:
            # aiohttp cancels the handler and logs nothing: when the client disconnected, or
            # at shutdown past the grace time (by then it has closed the transport too)
            state = request.app.get(STATE)
            cut = state is not None and state.stopping
            log_request(request, 503 if cut else CLIENT_CLOSED, time.monotonic() - start)
            raise


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers.setdefault(HEADER, request[REQUEST_ID])


def note(request: web.Request, api_id: str, reqs: list[Request], stream: bool) -> None:
    """What the engine did for this HTTP request, for its access-log line."""
    firsts = [r.stats.first_token_time for r in reqs if r.stats.first_token_time is not None]
    request[_NOTES] = {
        "id": api_id,
        "stream": stream,
        "prompt_tokens": sum(r.num_prompt_tokens for r in reqs),
        "completion_tokens": sum(len(r.output_ids) for r in reqs),
        "cached_tokens": sum(r.cache.num_cached_tokens for r in reqs),
        "ttft_s": round(min(firsts) - min(r.arrival for r in reqs), 4) if firsts else None,
        "finish": [r.finish_reason.value if r.finish_reason else None for r in reqs],
    }


def log_request(request: web.BaseRequest, status: int, seconds: float) -> None:
    emit = log.debug if request.path in ("/health", "/metrics") else log.info
    emit(
        "request",
        request_id=request.get(REQUEST_ID),
        method=request.method,
        path=request.path,
        status=status,
        seconds=round(seconds, 4),
        remote=request.remote,
        **request.get(_NOTES, {}),
    )


class AccessLogger(AbstractAccessLogger):
    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        log_request(request, response.status, time)
