"""Mooncake FAST'25 traces (JSON lines: `timestamp` ms, `input_length`, `output_length`,
`hash_ids`, each id one 512-token block) and their prompts as token ids: equal ids give equal
token blocks, different ids different ones, so the real prefix hashing finds what they share."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces


class TraceError(ValueError):
    """A trace line that is not a Mooncake request."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(
    path: str | Path, limit: int | None = None, until_s: float | None = None
) -> list[TraceRequest]:
    """The trace's requests in arrival order: the first `limit`, those arriving before
    `until_s` (seconds from the trace's start)."""
    out: list[TraceRequest] = []
    for req in _lines(Path(path)):
        if (limit is not None and len(out) >= limit) or (
            until_s is not None and req.arrival_s >= until_s
        ):
            break
        out.append(req)
    out.sort(key=lambda r: r.arrival_s)
    return out


def _lines(path: Path) -> Iterator[TraceRequest]:
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = orjson.loads(line)
                req = TraceRequest(
                    float(d["timestamp"]) / 1000.0,
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{path}:{number}: not a Mooncake trace request ({e})") from e
            if req.input_length < 1 or req.output_length < 1:
                raise TraceError(f"{path}:{number}: input and output lengths must be >= 1")
            if len(req.hash_ids) * TRACE_BLOCK < req.input_length:
                raise TraceError(
                    f"{path}:{number}: {len(req.hash_ids)} hash ids cover fewer than "
                    f"{req.input_length} input tokens"
                )
            yield req


@functools.lru_cache(maxsize=4096)  # shared prefixes (system prompts) come back often
def block_tokens(hash_id: int, vocab_size: int) -> tuple[int, ...]:
    """The 512 token ids of one hash id: its first three spell the id in base `vocab_size`
    (so different ids differ; vocabularies from 2**16 up spell any 48-bit id), the rest follow
    from it."""
    digits = [hash_id % vocab_size, (hash_id // vocab_size) % vocab_size]
    digits.append((hash_id // vocab_size**2) % vocab_size)
    step = 1 + hash_id % 7919
    rest = (hash_id + step * _OFFSETS) % vocab_size  # int64: exact below 2**63
    return tuple(digits + rest.tolist())


_OFFSETS = np.arange(TRACE_BLOCK - 3, dtype=np.int64)


def prompt_tokens(req: TraceRequest, vocab_size: int) -> list[int]:
    """The request's `input_length` prompt ids: its blocks' tokens, the last one cut short."""
    tokens: list[int] = []
    for h in req.hash_ids:
        tokens.extend(block_tokens(h, vocab_size))
        if len(tokens) >= req.input_length:
            break
    return tokens[: req.input_length]
