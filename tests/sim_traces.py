"""Small Mooncake-format traces and a hand-made cost table for the simulator's tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from daemon.sim.table import Bandwidth, CostTable, Grid, KVGeometry, Provenance

BLOCK = 16  # the table's KV block (tokens)


def table() -> CostTable:
    return CostTable(
        Provenance("test", "2026-12-02T00:00:00+00:00", "cpu", "made by hand", "float32"),
        KVGeometry(BLOCK, 2, 2, 16, "float32"),  # 8 KiB per block
        Grid([16, 2048], [0, 8192], [[0.01, 0.02], [0.2, 0.4]]),
        Grid([1, 64], [16, 8192], [[0.01, 0.02], [0.03, 0.1]]),
        Bandwidth(1e10),
        Bandwidth(1e10),
        Bandwidth(1e9, 1e-3),
        Bandwidth(1e9, 1e-3),
    )


def ceiling(lines: list[dict]) -> float:
    """Share of input tokens in blocks seen before: per request, its leading hash ids that an
    earlier request had, each the tokens of that block in this request; a request computes at
    least its last token, so its hit is cut to the whole KV blocks before it."""
    seen: set[int] = set()
    hit = total = 0
    for line in sorted(lines, key=lambda d: d["timestamp"]):
        n, ids = line["input_length"], line["hash_ids"]
        m = 0
        while m < len(ids) and ids[m] in seen:
            m += 1
        hit += min(min(512 * m, n), (n - 1) // BLOCK * BLOCK)
        total += n
        seen.update(ids)
    return hit / total


def conversations(
    seed: int = 0, sessions: int = 12, turns: int = 4, outputs: int = 3
) -> list[dict]:
    """Multi-turn chats over three shared system prompts: each turn is its parent's full
    blocks plus new ones, its last block cut short (new ids, as Mooncake's); `outputs`
    tokens answer each."""
    rng = random.Random(seed)
    next_id = iter(range(10**6))
    systems = [[next(next_id) for _ in range(rng.randint(1, 3))] for _ in range(3)]
    lines, t = [], 0
    for _ in range(sessions):
        full = list(rng.choice(systems))
        for _ in range(turns):
            new = [next(next_id) for _ in range(rng.randint(1, 3))]
            ids = full + new
            n = 512 * (len(ids) - 1) + rng.randint(1, 512)
            lines.append(
                {"timestamp": t, "input_length": n, "output_length": outputs, "hash_ids": ids}
            )
            full = ids[:-1] + [next(next_id)]  # the next turn: this one's blocks, answered
            t += 1000
    return lines


def write_trace(lines: list[dict], tmp_path: Path, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def interleaved(sessions: int, turns: int = 4) -> list[dict]:
    """`conversations` taken turn by turn across the sessions (each session's next turn comes
    after every other session's): a small device memory has evicted a turn's prefix by then."""
    lines = conversations(sessions=sessions, turns=turns)
    out = [lines[s * turns + t] for t in range(turns) for s in range(sessions)]
    for i, line in enumerate(out):
        line["timestamp"] = 1000 * i
    return out
