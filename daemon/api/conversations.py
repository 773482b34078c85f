"""POST /v1/chat/completions, /v1/responses and /v1/messages for the DeepSeek family, through
deepseek-recipe: convert, encode, generate, parse, then answer whole or as SSE."""

from __future__ import annotations

import time
import uuid

import structlog
from aiohttp import web

from daemon.api import access
from daemon.api.cache_options import cache_options
from daemon.api.chat_dense import handle_templated
from daemon.api.constraints import ENFORCED_KINDS
from daemon.api.errors import ApiError, bad_request, unavailable
from daemon.api.fanout import FanOut, submit_all
from daemon.api.sse import SSEWriter
from daemon.api.state import ApiState, get_state, read_json_object
from daemon.loop.constraint import GrammarConstraint
from daemon.loop.request import FinishReason, Request
from daemon.recipe.codec import CHAT, MESSAGES, RESPONSES, CodecError, Prepared, Protocol
from daemon.recipe.stream import OutputStream

log = structlog.get_logger(__name__)


async def handle(request: web.Request, protocol: Protocol) -> web.StreamResponse:
    state = get_state(request)
    body = await read_json_object(request)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    state.check_model(model)
    state.check_engine()
    if state.codec is None:
        if protocol is CHAT and state.chat_template is not None:
            return await handle_templated(request, state, body)
        raise bad_request(f"{request.path} is not available for this model (it has no chat codec)")
    rid = protocol.id_prefix + uuid.uuid4().hex
    try:
        prepared = state.codec.prepare(protocol, body, rid)
    except CodecError as e:
        raise bad_request(str(e)) from None
    prepared.params.constraint = await _constraint(state, prepared)
    state.check_capacity()
    cache = cache_options(request, body, state.engine)
    req = submit_all(state.engine, rid, [(prepared.prompt_ids, prepared.params)], cache=cache)[0]
    out = OutputStream(
        state.codec.processor(prepared), state.engine.eos_token_ids, len(req.prompt_ids)
    )
    try:
        if prepared.stream:
            return await _stream(request, state, protocol, req, out)
        return await _whole(state, protocol, req, out, rid)
    finally:
        out.close()
        access.note(request, rid, [req], prepared.stream)


async def _whole(
    state: ApiState, protocol: Protocol, req: Request, out: OutputStream, rid: str
) -> web.Response:
    acc = None
    async with FanOut(state.engine, [req]) as fan:
        async for _, o in fan:
            if o.finish_reason is FinishReason.ABORT:
                raise _aborted()
            events = out.feed(o)
            if acc is None:
                acc = protocol.response_cls(
                    rid,
                    state.served_name,
                    int(time.time()),
                    out.num_prompt_tokens,
                    out.num_cached_tokens,
                )
            for ev in events:
                acc.accumulate(ev)
    assert acc is not None
    return web.Response(body=acc.to_json(), content_type="application/json")


async def _stream(
    request: web.Request, state: ApiState, protocol: Protocol, req: Request, out: OutputStream
) -> web.StreamResponse:
    writer: SSEWriter | None = None
    name_of = protocol.response_cls.sse_event_name
    try:
        async with FanOut(state.engine, [req]) as fan:  # entered first: it aborts on any exit
            writer = await SSEWriter.open(request)
            async for _, o in fan:
                if o.finish_reason is FinishReason.ABORT:
                    await writer.send(_aborted_body(protocol), "error")
                    break
                for ev in out.feed(o):
                    await writer.send_raw(ev.to_json(), name_of(ev))
        done = protocol.response_cls.sse_done_data()
        if done is not None:
            await writer.send_raw(done)
        await writer.close()
    except ConnectionResetError:
        log.info("client_disconnected", id=req.request_id)
    if writer is None:
        raise ConnectionResetError("the client went away before the stream opened")
    return writer.response


async def _constraint(state: ApiState, prepared: Prepared) -> GrammarConstraint | None:
    """The recipe's json/regex OutputConstraint, enforced after the thinking block if any."""
    oc = prepared.constraint
    if oc is None or oc.kind not in ENFORCED_KINDS or state.constraints is None:
        return None
    compiled = await state.constraints.compile(oc.kind, oc.schema)
    trigger = state.codec.think_end_id if prepared.conversation.conversation.thinking_mode else None
    return GrammarConstraint(compiled, trigger)


def _aborted() -> ApiError:
    return unavailable(
        "the request was aborted before it finished (the server is shutting down "
        "or the engine failed)"
    )


def _aborted_body(protocol: Protocol) -> dict:
    err = _aborted()
    if protocol is MESSAGES:
        return {"type": "error", "error": {"type": "overloaded_error", "message": err.message}}
    return err.body()


routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, CHAT)


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    return await handle(request, RESPONSES)


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    return await handle(request, MESSAGES)


def register(app: web.Application) -> None:
    app.router.add_routes(routes)
