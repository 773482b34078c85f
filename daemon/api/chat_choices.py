"""n>1 Chat Completions through the recipe: every choice has its own parser, whose chunks and
response say index 0 and carry that choice's usage. These set each choice's index and report
the usage once, summed over the choices with the shared prompt counted once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

Json = dict[str, Any]


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
    """Rewrites the streamed chunks of `n` choices into one stream."""

    n: int
    usages: dict[int, Json] = field(default_factory=dict)

    def chunk(self, index: int, data: str) -> Json | None:
        """Choice `index`'s chunk (its to_json()) with the index set. Its usage is held back;
        the chunk that brings the last choice's usage carries the sum. None: nothing to send."""
        chunk = orjson.loads(data)
        for c in chunk.get("choices") or []:
            c["index"] = index
        if chunk.get("usage"):
            self.usages[index] = chunk["usage"]
            done = len(self.usages) == self.n
            chunk["usage"] = merge_usage([self.usages[i] for i in range(self.n)]) if done else None
        if not chunk.get("choices") and not chunk.get("usage"):
            return None
        return chunk


def merge_responses(responses: list[str]) -> bytes:
    """One chat.completion from the choices' own (each its to_json()), in choice order."""
    bodies = [orjson.loads(r) for r in responses]
    merged = bodies[0]
    merged["choices"] = [c | {"index": i} for i, b in enumerate(bodies) for c in b["choices"]]
    usages = [b["usage"] for b in bodies if b.get("usage")]
    if len(usages) == len(bodies):
        merged["usage"] = merge_usage(usages)
    return orjson.dumps(merged)
