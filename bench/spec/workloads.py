"""The workloads of bench.spec_decode as chat requests, seeded: (a) editing and summarising
passages of real prose, whose answers repeat their input, and (b) open chat."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.spec.questions import QUESTIONS, STYLES, WARMUP_QUESTIONS

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("edit", "chat")
TYPO = "Fix the typos in this text and return it in full."
# (a): what is asked of each passage; the typo instruction gets a passage with typos put in
INSTRUCTIONS = (
    TYPO,
    "Rewrite this paragraph, keeping its wording, and return all of it.",
    "Correct the grammar and punctuation of this text. Return only the corrected text.",
    "Repeat the following text exactly as it is written.",
    "Format this text as a bulleted list, one sentence per bullet, keeping its sentences.",
    "Edit this text for clarity while keeping its structure and most of its wording.",
    "Summarise the following text in a few sentences, reusing its key phrases.",
    "Summarise this text as a short list of its main points.",
)
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s*")
_WORD = re.compile(r"[^\W\d_]{4,}")


class WorkloadError(Exception):
    """No texts to cut passages from, or too few distinct requests for the grid."""


@dataclass(frozen=True)
class Passage:
    source: str  # the file's name
    text: str
    tokens: int


@dataclass
class ChatRequest:
    """One line of a `deepinfer bench serve --dataset jsonl` file, and where it came from."""

    messages: list[dict[str, str]]
    max_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return json.dumps({"messages": self.messages, "max_tokens": self.max_tokens})


def shared_texts(start: Path = ROOT) -> list[Path]:
    """The project's real prose: `shared/seeds/*.txt` (the seed articles) and `shared/docs/*.md`
    of the first `shared/` beside this checkout or above it; [] where there is none."""
    for d in (start, *start.parents):
        shared = d / "shared"
        if (shared / "seeds").is_dir():
            return sorted((shared / "seeds").glob("*.txt")) + sorted((shared / "docs").glob("*.md"))
    return []


def cut_passages(
    paths: Iterable[Path], count: Callable[[str], int], target_tokens: int
) -> list[Passage]:
    """Each file cut at line ends into passages of about `target_tokens` tokens (lines longer
    than that at sentence ends); a last piece under half the target is dropped."""
    out: list[Passage] = []
    for path in paths:
        pieces: list[str] = []
        for line in path.read_text(errors="replace").splitlines():
            line = line.strip()
            if not line:
                continue
            if count(line) <= target_tokens:
                pieces.append(line)
            else:
                pieces += [s for s in _SENTENCE_END.split(line) if s]
        chunk: list[str] = []
        size = 0
        for piece in pieces:
            chunk.append(piece)
            size += count(piece) + 1
            if size >= target_tokens:
                text = "\n".join(chunk)
                out.append(Passage(path.name, text, count(text)))
                chunk, size = [], 0
        if chunk and size >= target_tokens / 2:
            text = "\n".join(chunk)
            out.append(Passage(path.name, text, count(text)))
    return out


def with_typos(text: str, rng: random.Random, rate: float = 0.05) -> str:
    """`text` with two neighbouring inner letters swapped in about `rate` of its words of four
    letters or more."""

    def swap(m: re.Match[str]) -> str:
        w = m.group()
        if rng.random() >= rate:
            return w
        i = rng.randrange(1, len(w) - 2)
        return w[:i] + w[i + 1] + w[i] + w[i + 2 :]

    return _WORD.sub(swap, text)


def edit_requests(passages: list[Passage], seed: int, max_tokens: int) -> list[ChatRequest]:
    """Every passage under every instruction, in a seeded order."""
    rng = random.Random(f"edit-{seed}")
    reqs = []
    for p_i, p in enumerate(passages):
        for i_i, instruction in enumerate(INSTRUCTIONS):
            text = with_typos(p.text, rng) if instruction == TYPO else p.text
            reqs.append(
                ChatRequest(
                    [{"role": "user", "content": f"{instruction}\n\n{text}"}],
                    max_tokens,
                    {"source": p.source, "passage": p_i, "instruction": i_i, "tokens": p.tokens},
                )
            )
    rng.shuffle(reqs)
    return reqs


def chat_requests(seed: int, max_tokens: int) -> list[ChatRequest]:
    """Every question in every style, in a seeded order."""
    reqs = []
    for q_i, question in enumerate(QUESTIONS):
        for s_i, style in enumerate(STYLES):
            messages = [{"role": "system", "content": style}] if style else []
            messages.append({"role": "user", "content": question})
            reqs.append(ChatRequest(messages, max_tokens, {"question": q_i, "style": s_i}))
    random.Random(f"chat-{seed}").shuffle(reqs)
    return reqs


def warmup_requests(n: int, max_tokens: int) -> list[ChatRequest]:
    """Short questions none of the timed runs asks (their prefixes cache nothing of those)."""
    qs = [WARMUP_QUESTIONS[i % len(WARMUP_QUESTIONS)] for i in range(n)]
    return [ChatRequest([{"role": "user", "content": q}], max_tokens) for q in qs]


def split(pool: list[ChatRequest], sizes: list[int], name: str) -> list[list[ChatRequest]]:
    """Consecutive disjoint slices of `pool`, one per size: no run of a server repeats a
    request of an earlier run (its prefix would be cached, its answer known to a suffix
    index)."""
    if sum(sizes) > len(pool):
        raise WorkloadError(
            f"{name}: the grid needs {sum(sizes)} distinct requests per server, the workload "
            f"has {len(pool)}; lower --requests-per-slot / --min-requests or add texts"
        )
    out, at = [], 0
    for n in sizes:
        out.append(pool[at : at + n])
        at += n
    return out


def write_jsonl(reqs: list[ChatRequest], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r.line() + "\n" for r in reqs))
    return path


def describe(passages: list[Passage]) -> dict[str, Any]:
    """What the passages are, for the result file."""
    by_source: dict[str, list[int]] = {}
    for p in passages:
        by_source.setdefault(p.source, []).append(p.tokens)
    return {
        "passages": len(passages),
        "by_source": {s: {"passages": len(t), "tokens": sum(t)} for s, t in by_source.items()},
        "first": asdict(passages[0]) if passages else None,
    }
