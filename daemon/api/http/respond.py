"""A codec's call answered: its jobs submitted to the engine, their outputs made into the
protocol's answer, whole or streamed as SSE, and the request noted for the access log. Whatever
ends it (done, failed, cancelled, a client gone) aborts the engine requests left running."""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from daemon.api.codecs.base import Answer, Call, Event
from daemon.api.http import access
from daemon.api.http.cache_options import CacheOptions
from daemon.api.http.cluster_handoff import kv_source_for, routed_work
from daemon.api.http.errors import anthropic_error_body, bad_request, is_anthropic, unavailable
from daemon.api.http.fanout import FanOut, submit_all
from daemon.api.http.sse import SSEWriter
from daemon.loop.engine import Engine, RequestRejected
from daemon.loop.image_input import ImageRejected
from daemon.loop.images import EncoderFailed, ImageSpan
from daemon.loop.request import FinishReason, Request

log = structlog.get_logger(__name__)


async def respond(
    request: web.Request, engine: Engine, call: Call, cache: CacheOptions
) -> web.StreamResponse:
    # the images encode while the text before the first one prefills
    encoding = asyncio.ensure_future(engine.encode_images(call.images)) if call.images else None
    answer = call.answer()
    try:
        with routed_work(request):  # a role change waits for what it counts
            # a prompt with images is computed here (a handoff would need its images there)
            source = None if call.images else kv_source_for(request, len(call.jobs), cache)
            reqs = submit_all(engine, call.id, call.jobs, call.priority, cache, source, call.images)
            try:
                if encoding is not None:
                    await _images_ready(engine, call.id, reqs, encoding)
                if call.stream:
                    return await _stream(request, engine, reqs, call.id, answer)
                return await _whole(engine, reqs, answer)
            finally:
                access.note(request, call.id, reqs, call.stream)
    finally:
        if encoding is not None and not encoding.done():
            encoding.cancel()  # the request failed or went: nobody waits (the cache's own
            # encoding runs on for whoever else asks for the image)
        answer.close()


async def _images_ready(
    engine: Engine, call_id: str, reqs: list[Request], encoding: asyncio.Future[list[ImageSpan]]
) -> None:
    """The requests' images encoded and handed to them; else they are aborted (no answer has
    begun yet: a 503 to retry, or a 400)."""
    try:
        spans = await encoding
    except BaseException as e:
        for req in reqs:
            engine.abort(req.request_id)
        if isinstance(e, RequestRejected | ImageRejected):
            raise bad_request(str(e), e.param) from None
        if isinstance(e, EncoderFailed):
            log.warning("image_encoding_failed", request_id=call_id, error=str(e))
            raise unavailable(
                "the images could not be encoded; try again", retry_after_s=1
            ) from None
        raise
    for req in reqs:
        engine.images_ready(req, spans)


async def _whole(engine: Engine, reqs: list[Request], answer: Answer) -> web.Response:
    async with FanOut(engine, reqs) as fan:
        async for i, out in fan:
            if out.finish_reason is FinishReason.ABORT:
                raise unavailable(answer.aborted_message)
            answer.add(i, out)
    return web.Response(body=answer.body(), content_type="application/json")


async def _stream(
    request: web.Request, engine: Engine, reqs: list[Request], api_id: str, answer: Answer
) -> web.StreamResponse:
    writer: SSEWriter | None = None
    try:
        async with FanOut(engine, reqs) as fan:  # entered first: it aborts on any exit
            writer = await SSEWriter.open(request)
            await _send(writer, answer.opening())
            async for i, out in fan:
                if out.finish_reason is FinishReason.ABORT:
                    await writer.send(_aborted_body(request, answer), answer.error_event)
                    break
                await _send(writer, answer.events(i, out))
            else:
                await _send(writer, answer.closing())
        if answer.done_marker is not None:
            await writer.send_raw(answer.done_marker)
        await writer.close()
    except ConnectionResetError:
        log.info("client_disconnected", id=api_id)
    if writer is None:
        raise ConnectionResetError("the client went away before the stream opened")
    return writer.response


async def _send(writer: SSEWriter, events: list[Event]) -> None:
    for data, name in events:
        if isinstance(data, str):
            await writer.send_raw(data, name)
        else:
            await writer.send(data, name)


def _aborted_body(request: web.Request, answer: Answer) -> dict:
    """The error event of an aborted stream, in the protocol's shape."""
    err = unavailable(answer.aborted_message)
    if is_anthropic(request):
        return anthropic_error_body(err.status, err.message)
    return err.body()
