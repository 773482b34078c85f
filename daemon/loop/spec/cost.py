"""The step-cost table: step seconds measured on a grid of (num_tokens, num_seqs), interpolated
piecewise linearly (extrapolated linearly past its ends), with a per-sequence rollback cost and
what each decode row, and each draft row, costs per position of context beyond the grid's."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

FORMAT_VERSION = 1
MEMO_ENTRIES = 1 << 16  # the policy asks for the same few points every step


@dataclass
class CostRow:
    """Steps over `num_seqs` sequences: seconds at each measured total of tokens."""

    num_seqs: int
    num_tokens: list[int]  # ascending
    seconds: list[float]

    def __post_init__(self) -> None:
        if self.num_seqs < 1:
            raise ValueError("a cost row needs num_seqs >= 1")
        if not self.num_tokens or len(self.num_tokens) != len(self.seconds):
            raise ValueError("a cost row needs as many seconds as token counts, at least one")
        if any(b <= a for a, b in zip(self.num_tokens, self.num_tokens[1:])):
            raise ValueError("a cost row's token counts must be strictly ascending")
        if any(not s > 0 for s in self.seconds):
            raise ValueError("step seconds must be positive")

    def at(self, num_tokens: float) -> float:
        """Piecewise linear in the tokens; past either end along the nearest segment."""
        xs, ys = self.num_tokens, self.seconds
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, num_tokens), 1), len(xs) - 1)
        return _line(xs[i - 1], ys[i - 1], xs[i], ys[i], num_tokens)


@dataclass
class CostTable:
    """A `StepCost` from measured steps: rows by ascending `num_seqs`. Between rows the two
    rows' values at the same token count are interpolated linearly in the sequences; past the
    first or last row, extrapolated through the two nearest. Results never fall below the
    cheapest measured step (an extrapolation must not promise a step for free)."""

    rows: list[CostRow]
    # per verifying sequence: the cache's snapshot before the step and restore after a
    # rejection (no per-request state, as on dense models: only the calls themselves)
    rollback_seconds: float = 0.0
    device: str = ""
    # the positions each decode and draft row of the grid attended, and what a row costs per
    # position more: a row's attention reads its whole context (SmolLM2, 2 Zen 5 cores: a
    # draft row beside 32 decodes 0.6 ms at 128 positions, 0.8 at 384)
    context: int = 0
    context_seconds: float = 0.0
    # the same for a draft row (None: as a decode row). On CPU a request's verify rows read
    # each chunk of its context once for all of them (kernels/paged_attention_cpu.py): 64
    # sequences at 400 positions verifying 8 drafts each, 30 layers' attention 88 ms, against
    # 30 ms for their decodes alone and 204 ms with every row reading its context itself
    draft_context_seconds: float | None = None
    _floor: float = field(init=False, repr=False, compare=False)
    _memo: dict[tuple[int, int], float] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a cost table needs at least one row")
        seqs = [r.num_seqs for r in self.rows]
        if any(b <= a for a, b in zip(seqs, seqs[1:])):
            raise ValueError("cost rows must have strictly ascending num_seqs")
        if self.rollback_seconds < 0:
            raise ValueError("rollback_seconds must be >= 0")
        if self.context < 0 or self.context_seconds < 0 or self.per_draft_position < 0:
            raise ValueError("context, context_seconds and draft_context_seconds must be >= 0")
        self._floor = min(min(r.seconds) for r in self.rows)

    def seconds(
        self, num_tokens: int, num_seqs: int, num_drafts: int = 0, context: float | None = None
    ) -> float:
        """The step's time without rollbacks (`rollback_seconds` is per verifying sequence).
        The grid prices every token beyond one per sequence alike; `num_drafts` of them are
        draft rows, which with the decodes attend `context` positions on average (None: the
        grid's), each decode row `context_seconds` a position beyond the grid's (or less, short
        of it), each draft row `draft_context_seconds`."""
        key = (num_tokens, num_seqs)
        value = self._memo.get(key)
        if value is None:
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            value = self._memo[key] = max(self._interpolate(num_tokens, num_seqs), self._floor)
        if context is None or not (self.context_seconds or self.per_draft_position):
            return value
        per_position = self.context_seconds * num_seqs + self.per_draft_position * num_drafts
        return max(value + per_position * (context - self.context), self._floor)

    @property
    def per_draft_position(self) -> float:
        """What a draft row costs a position of context."""
        if self.draft_context_seconds is None:
            return self.context_seconds
        return self.draft_context_seconds

    def _interpolate(self, num_tokens: int, num_seqs: int) -> float:
        rows = self.rows
        if len(rows) == 1:
            return rows[0].at(num_tokens)
        seqs = [r.num_seqs for r in rows]
        i = min(max(bisect.bisect_right(seqs, num_seqs), 1), len(rows) - 1)
        lo, hi = rows[i - 1], rows[i]
        return _line(lo.num_seqs, lo.at(num_tokens), hi.num_seqs, hi.at(num_tokens), num_seqs)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": FORMAT_VERSION,
                "device": self.device,
                "rollback_seconds": self.rollback_seconds,
                "context": self.context,
                "context_seconds": self.context_seconds,
                "draft_context_seconds": self.draft_context_seconds,
                "rows": [
                    {"num_seqs": r.num_seqs, "num_tokens": r.num_tokens, "seconds": r.seconds}
                    for r in self.rows
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        data = json.loads(text)
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"cost table version {data.get('version')!r}, not {FORMAT_VERSION}")
        rows = [
            CostRow(int(r["num_seqs"]), [int(t) for t in r["num_tokens"]], list(r["seconds"]))
            for r in data["rows"]
        ]
        return cls(
            rows,
            float(data["rollback_seconds"]),
            str(data.get("device", "")),
            int(data.get("context", 0)),
            float(data.get("context_seconds", 0.0)),
            None if (draft := data.get("draft_context_seconds")) is None else float(draft),
        )


def _line(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
