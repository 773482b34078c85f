"""Chat Completions through the recipe: for n>1 every choice has its own parser, whose chunks and
response say index 0 and carry that choice's usage. These set each choice's index and report
the usage once, summed over the choices with the shared prompt counted once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

Json = dict[str, Any]
_NULL_USAGE = ',"usage":null}'  # how the recipe ends a chunk under include_usage


def merge_usage(usages: list[Json]) -> Json:
    """The prompt side from the first choice (they share the prompt), the completion summed."""
    merged = dict(usages[0])
    completion = sum(u.get("completion_tokens") or 0 for u in usages)
    merged["completion_tokens"] = completion
    merged["total_tokens"] = (merged.get("prompt_tokens") or 0) + completion
    details = [u["completion_tokens_details"] for u in usages if u.get("completion_tokens_details")]
    if details:
        merged["completion_tokens_details"] = {
            k: sum(d.get(k) or 0 for d in details) for k in details[0]
        }
    return merged


@dataclass
class ChunkMerger:
    """Rewrites the streamed chunks of `n` choices into one stream, with usage as OpenAI sends
    it: on no choice's chunk; with `include_usage`, in one last chunk of no choices."""

    n: int
    include_usage: bool = False
    usages: dict[int, Json] = field(default_factory=dict)
    last: Json | None = None  # the usage chunk, once every choice has brought its usage

    def chunk(self, index: int, data: str) -> str | Json | None:
        """Choice `index`'s chunk (its to_json()) with the index set and its usage taken off
        (`usage_chunk` sends the sum). None: nothing to send; a str: `data` to send as it is."""
        if self.n == 1 and (raw := self._as_is(data)) is not None:
            return raw
        chunk = orjson.loads(data)
        for c in chunk.get("choices") or []:
            c["index"] = index
        usage = chunk.pop("usage", None)
        if self.include_usage:
            chunk["usage"] = None
        if usage:
            self.usages[index] = usage
            if len(self.usages) == self.n:
                merged = merge_usage([self.usages[i] for i in range(self.n)])
                self.last = chunk | {"choices": [], "usage": merged}
        return chunk if chunk.get("choices") else None

    def _as_is(self, data: str) -> str | None:
        """A lone choice's chunk that carries no usage, sent without parsing it (the token
        chunks): the recipe writes choices last, so `}]` before the end means some. None: it
        must be parsed."""
        head = data[: -len(_NULL_USAGE)] if data.endswith(_NULL_USAGE) else data[:-1]
        if not head.endswith("}]") or '"usage"' in head:
            return None
        return head + (_NULL_USAGE if self.include_usage else "}")

    def usage_chunk(self) -> Json | None:
        """The chunk to send after every choice's last one (`stream_options.include_usage`)."""
        return self.last if self.include_usage else None


def merge_responses(responses: list[str]) -> bytes:
    """One chat.completion from the choices' own (each its to_json()), in choice order."""
    bodies = [orjson.loads(r) for r in responses]
    merged = bodies[0]
    merged["choices"] = [c | {"index": i} for i, b in enumerate(bodies) for c in b["choices"]]
    usages = [b["usage"] for b in bodies if b.get("usage")]
    if len(usages) == len(bodies):
        merged["usage"] = merge_usage(usages)
    return orjson.dumps(merged)
