"""POST /v1/chat/completions for dense families: the checkpoint's chat template, the engine's
own detokenizer and stop handling, OpenAI chat.completion(.chunk) objects."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import orjson
import structlog
from aiohttp import web

from daemon.api import access
from daemon.api.cache_options import cache_options, prompt_tokens_details
from daemon.api.completions_protocol import MAX_N
from daemon.api.errors import ApiError, unavailable
from daemon.api.fanout import FanOut, sample_jobs, submit_all
from daemon.api.logprobs import token_text
from daemon.api.params import get_bool, get_int, get_object, sampling_params
from daemon.api.sse import SSEWriter
from daemon.api.state import ApiState
from daemon.loop.request import FinishReason, Request, RequestOutput, TokenLogprob
from daemon.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.logprobs.extend(out.logprobs or [])
        self.completion_tokens = out.num_output_tokens
        self.cached_tokens = out.num_cached_tokens
        self.cached_tokens_by_tier = out.cached_tokens_by_tier
        if out.finished and out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value


@dataclass
class _Chat:
    id: str
    created: int
    model: str
    prompt_tokens: int
    tokenizer: TextTokenizer | None
    want_logprobs: bool
    choices: list[_Choice] = field(default_factory=list)

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        """The prompt counted once (the choices share it), the completions summed."""
        first = self.choices[0]
        completion = sum(ch.completion_tokens for ch in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": prompt_tokens_details(
                first.cached_tokens, first.cached_tokens_by_tier
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
    n = get_int(body, "n", 1, lo=1, hi=MAX_N) or 1
    # rendering and tokenizing a long conversation takes a while: off the event loop
    prompt_ids = await asyncio.to_thread(state.chat_template.encode, body)
    limit = get_int(body, "max_completion_tokens", lo=1) or get_int(body, "max_tokens", lo=1)
    max_tokens = limit or max(1, engine.max_model_len - len(prompt_ids))
    want_logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, lo=0, hi=20)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=top if want_logprobs else None)
    grammar = None
    if state.constraints is not None:
        grammar = await state.constraints.for_response_format(body.get("response_format"))
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
        [_Choice(i) for i in range(n)],
    )
    cache = cache_options(request, body, engine)
    reqs = submit_all(engine, c.id, sample_jobs(prompt_ids, params, n, grammar), cache=cache)
    try:
        if stream:
            return await _stream(request, state, reqs, c, include_usage)
        return await _whole(state, reqs, c)
    finally:
        access.note(request, c.id, reqs, stream)


async def _whole(state: ApiState, reqs: list[Request], c: _Chat) -> web.Response:
    async with FanOut(state.engine, reqs) as fan:
        async for i, out in fan:
            if out.finish_reason is FinishReason.ABORT:
                raise _aborted()
            c.choices[i].add(out)
    choices = [
        {
            "index": ch.index,
            "message": {"role": "assistant", "content": "".join(ch.text)},
            "logprobs": c.chat_logprobs(ch.logprobs),
            "finish_reason": ch.finish_reason,
        }
        for ch in c.choices
    ]
    body = c.header("chat.completion") | {"choices": choices, "usage": c.usage()}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(
    request: web.Request, state: ApiState, reqs: list[Request], c: _Chat, include_usage: bool
) -> web.StreamResponse:
    writer: SSEWriter | None = None
    head = c.header("chat.completion.chunk")
    try:
        async with FanOut(state.engine, reqs) as fan:  # entered first: it aborts on any exit
            writer = await SSEWriter.open(request)
            for ch in c.choices:
                first = {
                    "index": ch.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                await writer.send(head | {"choices": [first]})
            async for i, out in fan:
                if out.finish_reason is FinishReason.ABORT:
                    await writer.send(_aborted().body())
                    break
                ch = c.choices[i]
                ch.add(out)
                if not (out.new_text or out.finished or out.logprobs):
                    continue
                choice = {
                    "index": i,
                    "delta": {"content": out.new_text} if out.new_text else {},
                    "logprobs": c.chat_logprobs(out.logprobs),
                    "finish_reason": ch.finish_reason if out.finished else None,
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
