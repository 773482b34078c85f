"""One streamed /v1/completions (or, for chat messages, /v1/chat/completions) request over
aiohttp, timed chunk by chunk into a record."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class RequestRecord:
    """What one request did. Times in seconds; `start_s` and `chunk_s` since the run began."""

    index: int
    max_tokens: int
    session: int | None = None
    turn: int | None = None
    start_s: float = 0.0
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    counted_by: str = ""  # where output_tokens came from: usage | ids | tokenizer | chunks
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks carrying tokens
    chunk_s: list[float] = field(default_factory=list)  # arrival of each such chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in it (spread if unknown)
    # the answer, for multi-turn histories (not written to the result file)
    answer_ids: list[int] | None = field(default=None, repr=False)
    answer_text: str = field(default="", repr=False)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k not in ("answer_ids", "answer_text")}
        d["tpot_s"] = self.tpot_s
        return d


Payload = list[int] | str | list[dict[str, Any]]  # token ids, text or chat messages


@dataclass(frozen=True)
class Target:
    url: str  # the endpoint's full URL
    model: str
    headers: dict[str, str]
    prompt_format: str  # "ids" | "text"
    temperature: float
    ignore_eos: bool
    extra_body: dict[str, Any]

    def body(self, prompt: Payload, max_tokens: int) -> dict[str, Any]:
        """A completions body; for chat messages (a list of dicts) a chat one."""
        chat = bool(prompt) and isinstance(prompt, list) and isinstance(prompt[0], dict)
        body: dict[str, Any] = {
            "model": self.model,
            "messages" if chat else "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.prompt_format == "ids" and not chat:
            body["return_token_ids"] = True
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body | self.extra_body


async def _events(resp: aiohttp.ClientResponse):
    """SSE `data:` payloads as they arrive (no line-length limit: a first chunk may carry a
    long prompt's token ids)."""
    buf = b""
    async for piece in resp.content.iter_any():
        buf += piece
        while True:
            cut = buf.find(b"\n")
            if cut < 0:
                break
            line, buf = buf[:cut].strip(), buf[cut + 1 :]
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if buf.strip().startswith(b"data:"):
        yield buf.strip()[5:].strip()


async def stream_request(
    http: aiohttp.ClientSession,
    target: Target,
    prompt: Payload,
    rec: RequestRecord,
    t0: float,
    extra_headers: dict[str, str] | None = None,
    count_text: Callable[[str], int] | None = None,
) -> RequestRecord:
    """Send one streaming completion; fill `rec` (never raises for HTTP or stream errors).
    `count_text` counts an answer's tokens when the server reports neither usage nor ids."""
    start = time.perf_counter()
    rec.start_s = start - t0
    last = start
    ids: list[int] | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    headers = target.headers | (extra_headers or {})
    try:
        async with http.post(
            target.url, json=target.body(prompt, rec.max_tokens), headers=headers
        ) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return rec
            async for data in _events(resp):
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return rec
                now = time.perf_counter()
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    new_ids = choice.get("token_ids")
                    if new_ids is not None:
                        ids = (ids or []) + list(new_ids)
                    n = len(new_ids) if new_ids is not None else int(bool(piece))
                    if not n:
                        continue
                    text.append(piece)
                    if rec.ttft_s is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    rec.chunk_s.append(now - t0)
                    rec.chunk_tokens.append(n)
        rec.e2e_s = time.perf_counter() - start
    except (aiohttp.ClientError, OSError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:500]
        return rec
    if rec.ttft_s is None:
        rec.error = "the stream carried no tokens"
        return rec
    rec.answer_ids, rec.answer_text = ids, "".join(text)
    _count(rec, usage, ids, count_text)
    rec.ok = True
    return rec


def _count(
    rec: RequestRecord,
    usage: dict[str, Any] | None,
    ids: list[int] | None,
    count_text: Callable[[str], int] | None,
) -> None:
    """Token counts: the server's usage first, then returned ids, then the local tokenizer,
    then one per chunk."""
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.counted_by = "usage"
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    if not rec.output_tokens and ids is not None:
        rec.output_tokens, rec.counted_by = len(ids), "ids"
    if not rec.output_tokens and count_text is not None:
        rec.output_tokens, rec.counted_by = count_text(rec.answer_text), "tokenizer"
    if not rec.output_tokens:
        rec.output_tokens, rec.counted_by = len(rec.chunk_tokens), "chunks"
    if ids is None and rec.output_tokens != sum(rec.chunk_tokens):
        # text-only stream: spread the counted tokens over the chunks (for tokens/s over time)
        base, extra = divmod(rec.output_tokens, len(rec.chunk_tokens))
        rec.chunk_tokens = [base + (i < extra) for i in range(len(rec.chunk_tokens))]
