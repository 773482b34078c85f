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

from daemon.api.codecs.completions_protocol import MAX_N
from daemon.api.codecs.constraints import Grammar
from daemon.api.codecs.dense_tools import ToolRequest, tool_request
from daemon.api.codecs.logprobs import token_text
from daemon.api.codecs.tool_parsers import StreamParser, ToolCall, parse, stream_parser
from daemon.api.http import access
from daemon.api.http.cache_options import cache_options, prompt_tokens_details
from daemon.api.http.errors import ApiError, bad_request, unavailable
from daemon.api.http.fanout import FanOut, sample_jobs, submit_all
from daemon.api.http.params import get_bool, get_int, get_object, sampling_params
from daemon.api.http.sse import SSEWriter
from daemon.api.http.state import ApiState
from daemon.loop.request import FinishReason, Request, RequestOutput, TokenLogprob
from daemon.models.tokenizer import TextTokenizer

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
    parser: StreamParser | None = None  # streaming with tools: reads calls from the text
    num_calls: int = 0  # streamed so far

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
    tool_parser: str | None = None  # tools are on: their calls are read in this format

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
    tools = tool_request(body)
    parser = state.chat_template.tool_parser if tools.active else None
    if tools.active and parser is None:
        raise bad_request(
            "this model's chat template has no tool-call format; set server.tool_call_parser "
            "(hermes or llama3_json) or send tool_choice none",
            "tools",
        )
    # rendering and tokenizing a long conversation takes a while: off the event loop
    prompt_ids = await asyncio.to_thread(state.chat_template.encode, body, tools)
    limit = get_int(body, "max_completion_tokens", lo=1) or get_int(body, "max_tokens", lo=1)
    max_tokens = limit or max(1, engine.max_model_len - len(prompt_ids))
    want_logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, lo=0, hi=20)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=top if want_logprobs else None)
    grammar = None
    if tools.forced and parser is not None:
        grammar = await _forced_calls(state, parser, tools)
    elif state.constraints is not None:
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
        [_Choice(i, parser=stream_parser(parser) if parser and stream else None) for i in range(n)],
        parser,
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
    choices = []
    for ch in c.choices:
        message: dict = {"role": "assistant", "content": "".join(ch.text)}
        finish = ch.finish_reason
        if c.tool_parser is not None:
            parsed = parse(c.tool_parser, message["content"])
            message["content"] = parsed.content
            if parsed.calls:
                message["tool_calls"] = [call.to_json() for call in parsed.calls]
                finish = _finish_with_calls(finish)
        choices.append(
            {
                "index": ch.index,
                "message": message,
                "logprobs": c.chat_logprobs(ch.logprobs),
                "finish_reason": finish,
            }
        )
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
                deltas = _deltas(ch, out)
                if not (deltas or out.finished or out.logprobs):
                    continue
                deltas = deltas or [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    choice = {
                        "index": i,
                        "delta": delta,
                        "logprobs": c.chat_logprobs(out.logprobs) if k == 0 else None,
                        "finish_reason": _finish(ch) if out.finished and last else None,
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


async def _forced_calls(state: ApiState, parser: str, tools: ToolRequest) -> Grammar:
    """tool_choice required or named: the output is calls in the template's format."""
    assert state.constraints is not None  # a chat template implies a tokenizer
    single = tools.choice == "named" or not tools.parallel
    return await state.constraints.for_forced_calls(parser, tools.forced_tools(), single=single)


def _deltas(ch: _Choice, out: RequestOutput) -> list[dict]:
    """The chunk deltas of an output: its text, or with tools the content and the calls read
    from it, each call as OpenAI streams one (its id and name, then its arguments)."""
    if ch.parser is None:
        return [{"content": out.new_text}] if out.new_text else []
    events = ch.parser.feed(out.new_text) if out.new_text else []
    if out.finished:
        events += ch.parser.finish()
    deltas: list[dict] = []
    for ev in events:
        if isinstance(ev, ToolCall):
            head = {"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
            deltas.append({"tool_calls": [{"index": ch.num_calls} | head]})
            args = {"index": ch.num_calls, "function": {"arguments": ev.arguments}}
            deltas.append({"tool_calls": [args]})
            ch.num_calls += 1
        elif deltas and "content" in deltas[-1]:
            deltas[-1]["content"] += ev
        else:
            deltas.append({"content": ev})
    return deltas


def _finish(ch: _Choice) -> str | None:
    return _finish_with_calls(ch.finish_reason) if ch.num_calls else ch.finish_reason


def _finish_with_calls(finish: str | None) -> str | None:
    """An output that ended by itself after calls ends with them (a cut one stays "length")."""
    return "tool_calls" if finish == "stop" else finish


def _aborted() -> ApiError:
    return unavailable("the request was aborted before it finished")
