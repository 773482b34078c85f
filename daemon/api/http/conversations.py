"""POST /v1/chat/completions, /v1/responses and /v1/messages for the DeepSeek family, through
deepseek-recipe: convert, encode, generate, parse, then answer whole or as SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import structlog
from aiohttp import web

from daemon.api.codecs.chat_choices import ChunkMerger, merge_responses
from daemon.api.codecs.completions_protocol import MAX_N
from daemon.api.codecs.constraints import Grammar, OutputOptions
from daemon.api.codecs.recipe.codec import (
    CHAT,
    MESSAGES,
    RESPONSES,
    Accumulator,
    CodecError,
    Prepared,
    Protocol,
    RecipeCodec,
)
from daemon.api.codecs.recipe.stream import OutputStream
from daemon.api.http import access
from daemon.api.http.cache_options import cache_options
from daemon.api.http.chat_dense import handle_templated
from daemon.api.http.errors import ApiError, bad_request, unavailable
from daemon.api.http.fanout import FanOut, sample_jobs, submit_all
from daemon.api.http.params import JsonObject, get_bool, get_int, get_logit_bias, get_object
from daemon.api.http.sse import SSEWriter
from daemon.api.http.state import ApiState, get_state, read_json_object
from daemon.api.http.stored_responses import RESPONSE_STORE, Turn
from daemon.loop.request import FinishReason, Request

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
    n = 1
    if protocol is CHAT:  # the recipe takes n=1 only; the choices are ours
        n = get_int(body, "n", 1, lo=1, hi=MAX_N) or 1
        body = {k: v for k, v in body.items() if k != "n"}
    turn = None
    if protocol is RESPONSES:  # `store`, and `previous_response_id`'s conversation as the input
        body, turn = Turn.begin(request.app[RESPONSE_STORE], body)
    rid = protocol.id_prefix + uuid.uuid4().hex
    options, recipe_body = OutputOptions.read(protocol.name, body)
    prepared = await _prepare(state.codec, protocol, recipe_body, rid)
    if protocol is CHAT and (bias := get_logit_bias(body)):  # the recipe does not carry it
        prepared.params = replace(prepared.params, logit_bias=bias)
    grammar = await _grammar(state, prepared, options)
    state.check_capacity()
    cache = cache_options(request, body, state.engine)
    include_usage = protocol is CHAT and get_bool(
        get_object(body, "stream_options"), "include_usage"
    )
    eos, prompt_len = state.engine.eos_token_ids, len(prepared.prompt_ids)
    outs = [OutputStream(state.codec.processor(prepared), eos, prompt_len) for _ in range(n)]
    reqs: list[Request] = []
    try:
        jobs = sample_jobs(prepared.prompt_ids, prepared.params, n, grammar)
        reqs = submit_all(state.engine, rid, jobs, cache=cache)
        if prepared.stream:
            return await _stream(request, state, protocol, reqs, outs, turn, include_usage)
        return await _whole(state, protocol, reqs, outs, rid, turn)
    finally:
        for out in outs:
            out.close()
        if reqs:
            access.note(request, rid, reqs, prepared.stream)


async def _prepare(codec: RecipeCodec, protocol: Protocol, body: JsonObject, rid: str) -> Prepared:
    """Conversion and prompt encoding, in a worker thread: long conversations take a while."""
    try:
        return await asyncio.to_thread(codec.prepare, protocol, body, rid)
    except CodecError as e:
        raise bad_request(str(e)) from None


async def _whole(
    state: ApiState,
    protocol: Protocol,
    reqs: list[Request],
    outs: list[OutputStream],
    rid: str,
    turn: Turn | None = None,
) -> web.Response:
    accs: list[Accumulator | None] = [None] * len(reqs)
    created = int(time.time())
    async with FanOut(state.engine, reqs) as fan:
        async for i, o in fan:
            if o.finish_reason is FinishReason.ABORT:
                raise _aborted()
            events = outs[i].feed(o)
            acc = accs[i]
            if acc is None:
                acc = accs[i] = protocol.response_cls(
                    rid,
                    state.served_name,
                    created,
                    outs[i].num_prompt_tokens,
                    outs[i].num_cached_tokens,
                )
            for ev in events:
                acc.accumulate(ev)
    done = [acc for acc in accs if acc is not None]
    assert len(done) == len(reqs)
    body = done[0].to_json() if len(done) == 1 else merge_responses([a.to_json() for a in done])
    if turn is not None:
        body = turn.finish(body)
    return web.Response(body=body, content_type="application/json")


async def _stream(
    request: web.Request,
    state: ApiState,
    protocol: Protocol,
    reqs: list[Request],
    outs: list[OutputStream],
    turn: Turn | None = None,
    include_usage: bool = False,
) -> web.StreamResponse:
    writer: SSEWriter | None = None
    name_of = protocol.response_cls.sse_event_name
    merger = ChunkMerger(len(reqs), include_usage) if protocol is CHAT else None
    try:
        async with FanOut(state.engine, reqs) as fan:  # entered first: it aborts on any exit
            writer = await SSEWriter.open(request)
            async for i, o in fan:
                if o.finish_reason is FinishReason.ABORT:
                    await writer.send(_aborted_body(protocol), "error")
                    break
                for ev in outs[i].feed(o):
                    if merger is None:
                        data, name = ev.to_json(), name_of(ev)
                        if turn is not None:
                            data = turn.event(name, data)
                        await writer.send_raw(data, name)
                    elif isinstance(chunk := merger.chunk(i, ev.to_json()), str):
                        await writer.send_raw(chunk)
                    elif chunk is not None:
                        await writer.send(chunk)
            else:
                if merger is not None and (usage := merger.usage_chunk()) is not None:
                    await writer.send(usage)
        done = protocol.response_cls.sse_done_data()
        if done is not None:
            await writer.send_raw(done)
        await writer.close()
    except ConnectionResetError:
        log.info("client_disconnected", id=reqs[0].request_id)
    if writer is None:
        raise ConnectionResetError("the client went away before the stream opened")
    return writer.response


async def _grammar(state: ApiState, prepared: Prepared, options: OutputOptions) -> Grammar | None:
    """The recipe's OutputConstraint as a grammar, enforced after the thinking block if any."""
    oc = prepared.constraint
    if oc is None or state.constraints is None:
        return None
    assert state.codec is not None
    thinking = prepared.conversation.conversation.thinking_mode
    trigger = state.codec.think_end_id if thinking else None
    return await state.constraints.for_recipe(oc, options, trigger)


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
