"""Workloads of `deepinfer bench serve`: seeded random and shared-prefix prompts as token ids,
multi-turn chat/agent traces, a JSONL file of given requests, and the tokenizer that turns ids
into text for text-only servers."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.benchmark.traces import DEFAULTS, Kind, Session, TraceParams, Turn, make_trace, sessions


@dataclass
class Prompt:
    """One request of a flat dataset: token ids (and their text in text mode), answer length;
    or chat messages (for a chat endpoint), with no ids."""

    ids: list[int]
    max_tokens: int
    text: str | None = None
    messages: list[dict[str, Any]] | None = None

    @property
    def payload(self) -> list[int] | str | list[dict[str, Any]]:
        """What the request sends: messages, else the text, else the ids."""
        if self.messages is not None:
            return self.messages
        return self.text if self.text is not None else self.ids


class Codec:
    """A tokenizer.json: the ids random prompts draw from (no special tokens), ids -> text."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tokenizer = Tokenizer.from_file(str(file))
        special = {i for i, tok in self.tokenizer.get_added_tokens_decoder().items() if tok.special}
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.allowed = [i for i in range(size) if i not in special]

    @staticmethod
    def find(path: str | None) -> Codec | None:
        """The tokenizer at `path` (file or directory), or None when there is none."""
        if path is None:
            return None
        p = Path(path)
        if p.is_file() or (p / "tokenizer.json").is_file():
            return Codec(p)
        return None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text_of(self, ids: list[int]) -> str:
        """Text of about len(ids) tokens: decode, re-encode, cut to length, decode again
        (decoded random ids re-tokenize to a different count)."""
        again = self.tokenizer.encode(self.decode(ids), add_special_tokens=False).ids
        return self.decode(again[: len(ids)])


DEFAULT_VOCAB_SIZE = 32000  # ids are drawn below this with neither a vocab size nor a tokenizer


class TokenSource:
    """Seeded random token ids: from the codec's non-special ids, else [0, vocab_size)."""

    def __init__(self, seed: int, vocab_size: int | None, codec: Codec | None) -> None:
        self.rng = random.Random(seed)
        if vocab_size is not None:
            self.pool: list[int] | range = range(vocab_size)
        elif codec is not None:
            self.pool = codec.allowed
        else:
            self.pool = range(DEFAULT_VOCAB_SIZE)
        self.vocab_size = vocab_size or (max(self.pool) + 1)

    def ids(self, n: int) -> list[int]:
        return self.rng.choices(self.pool, k=n)

    def length(self, n: int, ratio: float) -> int:
        lo, hi = max(1, round(n * (1 - ratio))), max(1, round(n * (1 + ratio)))
        return self.rng.randint(lo, hi)


def random_prompts(
    src: TokenSource, input_len: int, output_len: int, ratio: float, codec: Codec | None
) -> Iterator[Prompt]:
    """Endless prompts of random ids, lengths uniform in len*(1 -/+ ratio)."""
    while True:
        ids = src.ids(src.length(input_len, ratio))
        text = codec.text_of(ids) if codec is not None else None
        yield Prompt(ids, src.length(output_len, ratio), text)


def prefix_sharing_prompts(
    src: TokenSource,
    prefix_len: int,
    num_prefixes: int,
    input_len: int,
    output_len: int,
    ratio: float,
    codec: Codec | None,
) -> Iterator[Prompt]:
    """Endless prompts: request i = prefix i mod num_prefixes (prefix_len tokens) + a random
    suffix of about input_len tokens."""
    prefixes = [src.ids(prefix_len) for _ in range(num_prefixes)]
    texts = [codec.text_of(p) for p in prefixes] if codec is not None else []
    i = 0
    while True:
        suffix = src.ids(src.length(input_len, ratio))
        text = texts[i % num_prefixes] + codec.text_of(suffix) if codec is not None else None
        yield Prompt(prefixes[i % num_prefixes] + suffix, src.length(output_len, ratio), text)
        i += 1


class DatasetError(ValueError):
    """A dataset file that cannot be read as one; the message names the line."""


def jsonl_prompts(path: str | Path, output_len: int) -> list[Prompt]:
    """The requests of a JSONL file, in order: `{"messages": [...]}` or `{"prompt": TEXT |
    [IDS]}` per line (blank lines skipped), `max_tokens` defaulting to `output_len`."""
    out: list[Prompt] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{n}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{n}: expected a JSON object")
        max_tokens = row.get("max_tokens", output_len)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise DatasetError(f"{path}:{n}: max_tokens must be a positive integer")
        messages, prompt = row.get("messages"), row.get("prompt")
        if (messages is None) == (prompt is None):
            raise DatasetError(f"{path}:{n}: expected exactly one of messages, prompt")
        if messages is not None:
            if not (isinstance(messages, list) and messages and _are_messages(messages)):
                raise DatasetError(f"{path}:{n}: messages must be a list of {{role, content}}")
            out.append(Prompt([], max_tokens, messages=messages))
        elif isinstance(prompt, str) and prompt:
            out.append(Prompt([], max_tokens, text=prompt))
        elif isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
            out.append(Prompt(prompt, max_tokens))
        else:
            raise DatasetError(f"{path}:{n}: prompt must be a non-empty string or list of ids")
    if not out:
        raise DatasetError(f"{path}: no requests")
    return out


def _are_messages(messages: list[Any]) -> bool:
    return all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)


def scaled_params(
    p: TraceParams,
    length_scale: float = 1.0,
    turns: tuple[int, int] | None = None,
    max_context: int | None = None,
) -> TraceParams:
    """A trace's parameters with every token length times `length_scale` (at least 1)."""

    def scale(r: tuple[int, int]) -> tuple[int, int]:
        return (
            max(1, round(r[0] * length_scale)) if r[0] else 0,
            max(1, round(r[1] * length_scale)),
        )

    changes: dict[str, object] = {}
    if length_scale != 1.0:
        for f in (
            "system_prompt_tokens",
            "first_message_tokens",
            "message_tokens",
            "answer_tokens",
        ):
            changes[f] = scale(getattr(p, f))
        if p.tool_sets:
            changes["tool_schema_tokens"] = scale(p.tool_schema_tokens)
        changes["message_median"] = max(1, round(p.message_median * length_scale))
        changes["answer_median"] = max(1, round(p.answer_median * length_scale))
    if turns is not None:
        changes["turns"] = turns
    if max_context is not None:
        changes["max_context_tokens"] = max_context
    return dataclasses.replace(p, **changes)  # type: ignore[arg-type]


def trace_sessions(
    kind: Kind,
    num_sessions: int,
    seed: int,
    vocab_size: int,
    params: TraceParams | None = None,
    max_turns: int | None = None,
) -> list[Session]:
    """The trace's sessions; with `max_turns`, only its first turns by nominal arrival (a
    prefix of each session, since a session's turns arrive in order)."""
    trace: list[Turn] = make_trace(kind, num_sessions, seed, vocab_size, params or DEFAULTS[kind])
    if max_turns is not None:
        trace = trace[:max_turns]
    return sessions(trace)
