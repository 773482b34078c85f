"""Engine outputs -> OpenAI chat.completion(.chunk) objects for dense families: the engine's own
detokenized text, with tool calls read back from it in the chat template's format."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import orjson

from daemon.api.codecs.base import Event
from daemon.api.codecs.logprobs import token_text
from daemon.api.codecs.tool_parsers import StreamParser, ToolCall, parse, stream_parser
from daemon.api.codecs.usage import prompt_tokens_details
from daemon.loop.request import RequestOutput, TokenLogprob
from daemon.models.tokenizer import TextTokenizer

ABORTED = "the request was aborted before it finished"


@dataclass
class DenseChoice:
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
class DenseChatAnswer:
    id: str
    created: int
    model: str
    prompt_tokens: int
    tokenizer: TextTokenizer | None
    want_logprobs: bool
    include_usage: bool
    n: int
    stream: bool
    tool_parser: str | None = None  # tools are on: their calls are read in this format
    choices: list[DenseChoice] = field(init=False)
    aborted_message: str = field(default=ABORTED, init=False)
    error_event: str | None = field(default=None, init=False)
    done_marker: str | None = field(default="[DONE]", init=False)

    def __post_init__(self) -> None:
        parser = self.tool_parser if self.stream else None  # streaming with tools
        self.choices = [
            DenseChoice(i, parser=stream_parser(parser) if parser else None) for i in range(self.n)
        ]

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @cached_property
    def chunk_head(self) -> dict:
        """Every stream chunk's header (built once per stream; chunks merge it, never edit it)."""
        return self.header("chat.completion.chunk")

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

    def add(self, index: int, out: RequestOutput) -> None:
        self.choices[index].add(out)

    def body(self) -> bytes:
        choices = []
        for ch in self.choices:
            message: dict = {"role": "assistant", "content": "".join(ch.text)}
            finish = ch.finish_reason
            if self.tool_parser is not None:
                parsed = parse(self.tool_parser, message["content"])
                message["content"] = parsed.content
                if parsed.calls:
                    message["tool_calls"] = [call.to_json() for call in parsed.calls]
                    finish = _finish_with_calls(finish)
            choices.append(
                {
                    "index": ch.index,
                    "message": message,
                    "logprobs": self._logprobs(ch.logprobs),
                    "finish_reason": finish,
                }
            )
        body = self.header("chat.completion") | {"choices": choices, "usage": self.usage()}
        return orjson.dumps(body)

    def opening(self) -> list[Event]:
        head = self.chunk_head
        return [
            (
                head
                | {
                    "choices": [
                        {
                            "index": ch.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                },
                None,
            )
            for ch in self.choices
        ]

    def events(self, index: int, out: RequestOutput) -> list[Event]:
        ch = self.choices[index]
        ch.add(out)
        deltas = _deltas(ch, out)
        if not (deltas or out.finished or out.logprobs):
            return []
        deltas = deltas or [{}]
        head = self.chunk_head
        events: list[Event] = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": self._logprobs(out.logprobs) if k == 0 else None,
                "finish_reason": _finish(ch) if out.finished and last else None,
            }
            events.append((head | {"choices": [choice]}, None))
        return events

    def closing(self) -> list[Event]:
        if not self.include_usage:
            return []
        return [(self.chunk_head | {"choices": [], "usage": self.usage()}, None)]

    def close(self) -> None:
        """Nothing to release: the choices are plain data."""

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
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


def _deltas(ch: DenseChoice, out: RequestOutput) -> list[dict]:
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


def _finish(ch: DenseChoice) -> str | None:
    return _finish_with_calls(ch.finish_reason) if ch.num_calls else ch.finish_reason


def _finish_with_calls(finish: str | None) -> str | None:
    """An output that ended by itself after calls ends with them (a cut one stays "length")."""
    return "tool_calls" if finish == "stop" else finish
