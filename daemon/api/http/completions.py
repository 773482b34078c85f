"""POST /v1/completions: OpenAI legacy completions, answered whole or streamed as SSE."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import orjson
import structlog
from aiohttp import web

from daemon.api.codecs.completions_protocol import (
    CompletionRequest,
    parse_completion_request,
    tokenize_prompts,
)
from daemon.api.codecs.logprobs import completion_logprobs, vllm_prompt_logprobs
from daemon.api.http import access
from daemon.api.http.cache_options import cache_options, prompt_tokens_details
from daemon.api.http.errors import ApiError, unavailable
from daemon.api.http.fanout import FanOut, submit_all
from daemon.api.http.sse import SSEWriter
from daemon.api.http.state import get_state, read_json_object
from daemon.loop.engine import Engine
from daemon.loop.request import FinishReason, Request, RequestOutput, TokenLogprob
from daemon.models.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)
routes = web.RouteTableDef()


@dataclass
class _Completion:
    """One HTTP completion request: its choices are (prompt i, sample j) -> index i*n + j."""

    id: str
    created: int
    model: str
    req: CompletionRequest
    prompt_ids: list[list[int]]
    tokenizer: TextTokenizer | None
    choices: list[_Choice] = field(default_factory=list)

    def header(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(ch.num_output_tokens for ch in self.choices)
        firsts = self.choices[:: self.req.n]  # the n choices of a prompt share its prefix
        by_tier: dict[str, int] = {}
        for ch in firsts:
            for tier, n in ch.cached_tokens_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": prompt_tokens_details(
                sum(ch.num_cached_tokens for ch in firsts), by_tier
            ),
        }


@dataclass
class _Choice:
    index: int
    prompt_ids: list[int]
    prompt_text: str = ""  # echoed before the completion
    echo_only: bool = False  # the prompt alone: the one token computed is not part of the answer
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # streaming: where the next chunk's logprobs start
    streamed: bool = False  # streaming: a chunk of this choice has been sent
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if not self.echo_only:
            self.text.append(out.new_text)
            self.token_ids.extend(out.new_token_ids)
            self.logprobs.extend(out.logprobs or [])
            self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.cached_tokens_by_tier = out.cached_tokens_by_tier or {}
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            if self.echo_only and out.finish_reason is not FinishReason.ABORT:
                self.finish_reason, self.stop_reason = FinishReason.LENGTH, None


@routes.post("/v1/completions")
async def create_completion(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    body = await read_json_object(request)
    creq = parse_completion_request(body)
    state.check_model(creq.model)
    state.check_engine()
    engine = state.engine
    cache = cache_options(request, body, engine)
    prompt_ids = await tokenize_prompts(creq.prompts, engine.tokenizer)
    state.check_capacity()
    c = _Completion(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=state.served_name,
        req=creq,
        prompt_ids=prompt_ids,
        tokenizer=engine.tokenizer,
    )
    jobs = [(ids, creq.params_for(j)) for ids in prompt_ids for j in range(creq.n)]
    texts = [
        _echoed(p, ids, engine.tokenizer) if creq.echo else ""
        for p, ids in zip(creq.prompts, prompt_ids)
    ]
    c.choices = [
        _Choice(i, ids, texts[i // creq.n], creq.echo_only) for i, (ids, _) in enumerate(jobs)
    ]
    reqs = submit_all(engine, c.id, jobs, creq.priority, cache)
    try:
        if creq.stream:
            return await _stream(request, engine, reqs, c)
        return await _whole(engine, reqs, c)
    finally:
        access.note(request, c.id, reqs, creq.stream)


async def _whole(engine: Engine, reqs: list[Request], c: _Completion) -> web.Response:
    async with FanOut(engine, reqs) as fan:
        async for i, out in fan:
            c.choices[i].add(out)
    if any(ch.finish_reason is FinishReason.ABORT for ch in c.choices):
        raise _aborted()
    choices = []
    for ch in c.choices:
        choice = {
            "index": ch.index,
            "text": ch.prompt_text + "".join(ch.text),
            "logprobs": _logprobs(c, ch, ch.logprobs, 0, first=True)[0],
            "finish_reason": ch.finish_reason.value if ch.finish_reason else None,
            "stop_reason": ch.stop_reason,
        }
        if c.req.params.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(ch.prompt_logprobs or [], c.tokenizer)
        if c.req.return_token_ids:
            choice |= {"prompt_token_ids": ch.prompt_ids, "token_ids": ch.token_ids}
        choices.append(choice)
    body = c.header() | {"choices": choices, "usage": c.usage()}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(
    request: web.Request, engine: Engine, reqs: list[Request], c: _Completion
) -> web.StreamResponse:
    writer: SSEWriter | None = None
    try:
        async with FanOut(engine, reqs) as fan:  # entered first: it aborts on any exit
            writer = await SSEWriter.open(request)
            async for i, out in fan:
                ch = c.choices[i]
                ch.add(out)
                if out.finish_reason is FinishReason.ABORT:
                    await writer.send(_aborted().body())
                    break
                if not (out.new_token_ids or out.new_text or out.finished):
                    continue
                text, token_ids, entries = out.new_text, out.new_token_ids, out.logprobs
                if ch.echo_only:
                    text, token_ids, entries = "", [], []
                if not ch.streamed:
                    text = ch.prompt_text + text
                finish = ch.finish_reason if out.finished else None
                choice = {
                    "index": i,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish.value if finish else None,
                    "stop_reason": ch.stop_reason if out.finished else None,
                }
                choice["logprobs"], ch.text_offset = _logprobs(
                    c, ch, entries, ch.text_offset, first=not ch.streamed
                )
                if c.req.return_token_ids:
                    if not ch.streamed:
                        choice["prompt_token_ids"] = ch.prompt_ids
                    choice["token_ids"] = token_ids
                ch.streamed = True
                await writer.send(c.header() | {"choices": [choice]})
            else:
                if c.req.include_usage:
                    await writer.send(c.header() | {"choices": [], "usage": c.usage()})
        await writer.done()
        await writer.close()
    except ConnectionResetError:
        log.info("client_disconnected", id=c.id)
    if writer is None:
        raise ConnectionResetError("the client went away before the stream opened")
    return writer.response


def _logprobs(
    c: _Completion, ch: _Choice, entries: list[TokenLogprob] | None, offset: int, first: bool
) -> tuple[dict | None, int]:
    """The legacy logprobs of these output tokens; with echo, the first part (a whole answer or
    the first chunk) starts with the prompt's."""
    top_n = c.req.params.logprobs
    if top_n is None or entries is None:
        return None, offset
    unscored: list[int] = []
    if c.req.echo and first and ch.prompt_logprobs:
        unscored = ch.prompt_ids[:1]
        entries = [e for e in ch.prompt_logprobs[1:] if e is not None] + entries
    return completion_logprobs(entries, c.tokenizer, offset, unscored=unscored, top_n=top_n)


def _echoed(prompt: str | list[int], ids: list[int], tokenizer: TextTokenizer | None) -> str:
    """The prompt's text, as an echo shows it (token-id prompts are decoded)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(ids) if tokenizer is not None else ""


def _aborted() -> ApiError:
    return unavailable(
        "the request was aborted before it finished (the server is shutting down "
        "or the engine failed)"
    )


def register(app: web.Application) -> None:
    app.router.add_routes(routes)
