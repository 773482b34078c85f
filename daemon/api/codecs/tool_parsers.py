"""Tool calls in dense models' output, in the formats vLLM's `hermes` (Qwen: <tool_call>{json}
</tool_call>) and `llama3_json` (Llama 3.1+: {"name": ..., "parameters": ...}; ...) parsers read."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Event = str | ToolCall  # a piece of content text, or one whole call


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall]


class StreamParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def stream_parser(name: str) -> StreamParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool-call parser {name!r}")


def parse(name: str, text: str) -> Parsed:
    """A whole output: the content (None when only calls and whitespace) and the calls.
    The same parser as a stream's, so whole and streamed answers agree."""
    p = stream_parser(name)
    events = p.feed(text) + p.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    if calls and not content.strip():
        return Parsed(None, calls)
    return Parsed(content, calls)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, args_key: tuple[str, ...]) -> ToolCall | None:
    """A call from a parsed JSON object with a string name and an object of arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_key if k in obj), {})
    if isinstance(args, str):  # some models send the arguments JSON-encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may be)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class HermesParser:
    """Text, then calls each in <tool_call>...</tool_call>; text between or after calls is
    dropped (as vLLM does), a last call left open at the end is read as if closed, and a call
    that is not a JSON object with a name becomes content again."""

    START = "<tool_call>"
    END = "</tool_call>"
    buf: str = ""
    in_calls: bool = False
    held: str = ""  # whitespace before a possible first call, emitted if no call follows

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        if not self.in_calls:
            at = self.buf.find(self.START)
            if at < 0:
                keep = _partial_suffix(self.buf, self.START)
                ready, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return self._text(ready)
            out += self._text(self.buf[:at], final=True)
            self.buf = self.buf[at:]
            self.in_calls = True
        while True:
            start = self.buf.find(self.START)
            if start < 0:
                # between calls: only a possible next start is worth keeping
                self.buf = self.buf[len(self.buf) - _partial_suffix(self.buf, self.START) :]
                return out
            end = self.buf.find(self.END, start)
            if end < 0:
                self.buf = self.buf[start:]
                return out
            out.append(self._segment(self.buf[start : end + len(self.END)]))
            self.buf = self.buf[end + len(self.END) :]

    def finish(self) -> list[Event]:
        rest, self.buf = self.buf, ""
        if not self.in_calls:
            return self._text(rest, final=True, flush=True)
        if rest.startswith(self.START):
            return [self._segment(rest)]
        return []

    def _segment(self, raw: str) -> Event:
        body = raw[len(self.START) :].removesuffix(self.END).strip()
        return _call(_loads(body), ("arguments", "parameters")) or raw

    def _text(self, text: str, final: bool = False, flush: bool = False) -> list[Event]:
        """Content, with trailing whitespace held back until what follows it is known: a call
        (final=True: dropped) or more text (emitted)."""
        text = self.held + text
        if flush:
            self.held = ""
            return [text] if text else []
        body = text.rstrip()
        self.held = "" if final else text[len(body) :]
        return [body] if body else []


@dataclass
class Llama3JsonParser:
    """An output that starts (after whitespace and an optional <|python_tag|>) with a JSON
    object is one or more calls {"name": ..., "parameters"|"arguments": {...}} separated by
    ';'; anything else is content. What does not parse becomes content again, and the whole
    output does when no call parsed."""

    TAG = "<|python_tag|>"
    buf: str = ""
    mode: str = "start"  # start | text | calls
    raw: str = ""  # every character seen in calls mode, for the all-text fallback
    pos: int = 0  # in calls mode: where the next object begins in buf
    called: bool = False
    failed: bool = False
    scan: _ObjectScan | None = None  # the object being read, kept across feeds
    scanned: int = 0  # characters read by object scans so far

    def feed(self, text: str) -> list[Event]:
        if self.mode == "text":
            return [text] if text else []
        self.buf += text
        if self.mode == "start":
            head = self.buf.lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return []
            body = head.removeprefix(self.TAG).lstrip()
            if not body:
                return []
            if not body.startswith("{"):
                self.mode, text, self.buf = "text", self.buf, ""
                return [text]
            self.mode, self.raw = "calls", self.buf
            self.buf = body
        else:
            self.raw += text
        return self._objects()

    def finish(self) -> list[Event]:
        if self.mode == "text":
            return []
        if self.mode == "start":
            return [self.buf] if self.buf else []
        if not self.called:
            return [self.raw] if self.raw else []
        rest = self.buf[self.pos :].strip().lstrip(";").strip()
        return [rest] if rest else []

    def _objects(self) -> list[Event]:
        out: list[Event] = []
        while not self.failed:
            i = self._skip(self.pos)
            if i >= len(self.buf):
                break
            if self.buf[i] != "{":
                self.failed = True
                break
            if self.scan is None or self.scan.start != i:
                self.scan = _ObjectScan(i)
            end = self.scan.end(self.buf)
            self.scanned += self.scan.scanned
            self.scan.scanned = 0
            if end is None:
                break
            self.scan = None
            call = _call(_loads(self.buf[i:end]), ("parameters", "arguments"))
            if call is None:
                self.failed = True
                break
            self.called = True
            out.append(call)
            self.pos = end
        return out

    def _skip(self, i: int) -> int:
        while i < len(self.buf) and (self.buf[i].isspace() or self.buf[i] == ";"):
            i += 1
        return i


@dataclass
class _ObjectScan:
    """Finds where the JSON object opening at buf[start] closes; the state is kept between
    calls so a growing buffer is read once, not from `start` again on every chunk."""

    start: int
    i: int = -1  # the next index to read; -1 until the first call
    depth: int = 0
    in_str: bool = False
    escape: bool = False
    scanned: int = 0

    def end(self, text: str) -> int | None:
        """The index just past the object, or None if `text` does not close it yet."""
        i = self.start if self.i < 0 else self.i
        depth, in_str, escape = self.depth, self.in_str, self.escape
        n = len(text)
        first = i
        found: int | None = None
        while i < n:
            c = text[i]
            i += 1
            if in_str:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    found = i
                    break
        self.i, self.depth, self.in_str, self.escape = i, depth, in_str, escape
        self.scanned += i - first
        return found
