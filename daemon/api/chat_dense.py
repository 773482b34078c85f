"""POST /v1/chat/completions for dense families: the checkpoint's chat template, the engine's
own detokenizer and stop handling, OpenAI chat.completion(.chunk) objects."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import orjson
import structlog
from aiohttp import web

from daemon.api import access
from daemon.api.cache_options import cache_options, prompt_tokens_details
from daemon.api.errors import ApiError, bad_request, unavailable
from daemon.api.fanout import FanOut, submit_all
from daemon.api.logprobs import token_text
from daemon.api.params import get_bool, get_int, get_object, sampling_params
from daemon.api.sse import SSEWriter
from daemon.api.state import ApiState
from daemon.loop.request import FinishReason, Request, RequestOutput, TokenLogprob
from daemon.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)


@dataclass
class _Chat:
    id: str
    created: int
    model: str
    prompt_tokens: int
    tokenizer: TextTokenizer | None
    want_logprobs: bool
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.logprobs.extend(out.logprobs or [])
        self.completion_tokens = out.num_output_tokens
        self.cached_tokens = out.num_cached_tokens
        self.cached_tokens_by_tier = out.cached_tokens_by_tier
        if out.finished and out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": prompt_tokens_details(
                self.cached_tokens, self.cached_tokens_by_tier
            ),
        }

    def chat_logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if not self.want_logprobs:
            return None
        return {"content": [self._entry(e) for e in entries or []]}

    def _entry(self, e: TokenLogprob) -> dict:
        text = token_text(self.tokenizer, e.token_id)
        top = [
            {
                "token": (t := token_text(self.tokenizer, i)),
                "logprob": lp,
                "bytes": list(t.encode()),
            }
            for i, lp in e.top
        ]
        return {
            "token": text,
            "logprob": e.logprob,
            "bytes": list(text.encode()),
            "top_logprobs": top,
        }


async def handle_templated(request: web.Request, state: ApiState, body: dict) -> web.StreamResponse:
    assert state.chat_template is not None
    engine = state.engine
    prompt_ids = state.chat_template.encode(body)
    if get_int(body, "n", 1, lo=1, hi=1) != 1:
        raise bad_request("only n=1 is supported", "n")
    limit = get_int(body, "max_completion_tokens", lo=1) or get_int(body, "max_tokens", lo=1)
    max_tokens = limit or max(1, engine.max_model_len - len(prompt_ids))
    want_logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, lo=0, hi=20)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=top if want_logprobs else None)
    if state.constraints is not None:
        params.constraint = await state.constraints.for_response_format(body.get("response_format"))
    stream = get_bool(body, "stream")
    include_usage = get_bool(get_object(body, "stream_options"), "include_usage")
    state.check_capacity()
    c = _Chat(
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        state.served_name,
        len(prompt_ids),
        engine.tokenizer,
        want_logprobs,
    )
    cache = cache_options(request, body, engine)
    req = submit_all(engine, c.id, [(prompt_ids, params)], cache=cache)[0]
    try:
        if stream:
            return await _stream(request, state, req, c, include_usage)
        return await _whole(state, req, c)
    finally:
        access.note(request, c.id, [req], stream)


async def _whole(state: ApiState, req: Request, c: _Chat) -> web.Response:
    async with FanOut(state.engine, [req]) as fan:
        async for _, out in fan:
            if out.finish_reason is FinishReason.ABORT:
                raise _aborted()
            c.add(out)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(c.text)},
        "logprobs": c.chat_logprobs(c.logprobs),
        "finish_reason": c.finish_reason,
    }
    body = c.header("chat.completion") | {"choices": [choice], "usage": c.usage()}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(
    request: web.Request, state: ApiState, req: Request, c: _Chat, include_usage: bool
) -> web.StreamResponse:
    writer: SSEWriter | None = None
    head = c.header("chat.completion.chunk")
    try:
        async with FanOut(state.engine, [req]) as fan:
            writer = await SSEWriter.open(request)
            first = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await writer.send(head | {"choices": [first]})
            async for _, out in fan:
                if out.finish_reason is FinishReason.ABORT:
                    await writer.send(_aborted().body())
                    break
                c.add(out)
                if not (out.new_text or out.finished or out.logprobs):
                    continue
                choice = {
                    "index": 0,
                    "delta": {"content": out.new_text} if out.new_text else {},
                    "logprobs": c.chat_logprobs(out.logprobs),
                    "finish_reason": c.finish_reason if out.finished else None,
                }
                await writer.send(head | {"choices": [choice]})
            else:
                if include_usage:
                    await writer.send(head | {"choices": [], "usage": c.usage()})
        await writer.done()
        await writer.close()
    except ConnectionResetError:
        log.info("client_disconnected", id=c.id)
    if writer is None:
        raise ConnectionResetError("the client went away before the stream opened")
    return writer.response


def _aborted() -> ApiError:
    return unavailable("the request was aborted before it finished")
