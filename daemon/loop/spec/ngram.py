"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of a request's
own last tokens, with confidences from the observed acceptance of such matches."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.loop.spec.base import Draft

if TYPE_CHECKING:
    from daemon.loop.request import Request


@dataclass
class LookupDraft(Draft):
    """A lookup drafter's proposal, with what `observe` needs to credit it."""

    source: str = "none"  # "ngram" (the request's own tokens), "suffix" (earlier requests)
    match_len: int = 0  # how many of the request's last tokens the match covers
    kind: int = 0  # the request's kind its outcomes are counted under (MatchStats)


class MatchStats:
    """Acceptance by (request kind, match length n, draft position j), as counts of outcomes.

    Cell (kind, n, j) counts the drafts of match length n, made for requests of that kind,
    whose position j was decided with all of positions < j accepted, and how many of those
    accepted j: its rate estimates P(accept j | accepted < j). The kind is the caller's label
    of what a request is doing (`NgramDrafter`: how much its output repeats). A cell shrinks
    toward its kind's rate at j over every n, that toward the rate at j over every kind, and
    that toward `prior`, each with the weight of `strength` outcomes, so unseen cells start
    sane and a cell's own evidence takes over as it accumulates.

    Every outcome's weight decays by `memory` per later outcome (in any cell), so the table
    weighs about the last 1 / (1 - memory) outcomes: when the traffic changes (edits, then
    chat), the estimates follow within a few hundred outcomes, not after a cell's thousands
    of outcomes of the old traffic have been outweighed."""

    def __init__(self, prior: float = 0.5, strength: float = 4.0, memory: float = 0.998) -> None:
        if not 0.0 < memory <= 1.0:
            raise ValueError("the match statistics' memory must be in (0, 1]")
        self.prior = prior
        self.strength = strength
        self.memory = memory
        self.outcomes = 0  # outcomes ever recorded
        # the weight of the next outcome: it grows by 1 / memory per outcome, so the counts
        # over the latest outcome's weight are the decayed counts
        self._weight = 1.0
        # (kind, n) -> (accepted, tried) by position, in outcome weights
        self._cells: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
        self._cols = 0
        # the estimates, rebuilt after an outcome: per cell, per kind, over all
        self._rates: dict[tuple[int, int], list[float]] | None = None
        self._kind_rates: dict[int, list[float]] = {}
        self._pooled: list[float] = []

    def record(self, n: int, j: int, accepted: bool, kind: int = 0) -> None:
        """Position `j` of a draft of match length `n` for a request of `kind`, whose
        positions < j were accepted."""
        acc, tried = self._cells.setdefault((kind, n), ([], []))
        if j >= len(tried):
            acc.extend([0.0] * (j + 1 - len(acc)))
            tried.extend([0.0] * (j + 1 - len(tried)))
            self._cols = max(self._cols, j + 1)
        w = self._weight
        tried[j] += w
        if accepted:
            acc[j] += w
        self._weight = w / self.memory
        if self._weight > 1e12:  # rescaled before the sums lose the small weights
            for a, t in self._cells.values():
                a[:] = [x / w for x in a]
                t[:] = [x / w for x in t]
            self._weight = 1.0 / self.memory
        self.outcomes += 1
        self._rates = None

    def observe(self, n: int, verified: int, accepted: int, kind: int = 0) -> None:
        """A draft of match length `n`: `verified` positions verified, the first `accepted`
        of them accepted (the one after, if verified, rejected)."""
        for j in range(min(accepted + 1, verified)):
            self.record(n, j, j < accepted, kind)

    def confidence(self, n: int, length: int, kind: int = 0) -> list[float]:
        """P(accept j | accepted < j) for j < `length`, for a match of length `n` made for a
        request of `kind`."""
        if length <= 0:
            return []
        if self._rates is None:
            self._rates = self._estimate()
        rates = self._rates.get((kind, n)) or self._kind_rates.get(kind) or self._pooled
        if len(rates) < length:  # positions no draft has reached: the prior
            rates = rates + [self.prior] * (length - len(rates))
        return rates[:length]

    def _estimate(self) -> dict[tuple[int, int], list[float]]:
        s, cols = self.strength, self._cols
        latest = self._weight * self.memory  # the latest outcome's weight, which counts 1
        pad = [0.0] * cols
        cells = {  # decayed counts, every cell `cols` positions long
            key: (([x / latest for x in a] + pad)[:cols], ([x / latest for x in t] + pad)[:cols])
            for key, (a, t) in self._cells.items()
        }

        def shrunk(sums: tuple[list[float], list[float]], toward: list[float]) -> list[float]:
            acc, tried = sums
            return [(acc[j] + s * toward[j]) / (tried[j] + s) for j in range(cols)]

        self._pooled = shrunk(_summed(cells.values(), cols), [self.prior] * cols)
        by_kind: dict[int, list[tuple[list[float], list[float]]]] = {}
        for (kind, _), c in cells.items():
            by_kind.setdefault(kind, []).append(c)
        self._kind_rates = {
            kind: shrunk(_summed(cs, cols), self._pooled) for kind, cs in by_kind.items()
        }
        return {key: shrunk(c, self._kind_rates[key[0]]) for key, c in cells.items()}


def _summed(
    cells: Iterable[tuple[list[float], list[float]]], cols: int
) -> tuple[list[float], list[float]]:
    """The (accepted, tried) sums of `cells` (each `cols` positions long) by position."""
    acc, tried = [0.0] * cols, [0.0] * cols
    for a, t in cells:
        for j in range(cols):
            acc[j] += a[j]
            tried[j] += t[j]
    return acc, tried


class RequestRates:
    """One request's own acceptance by draft position: decayed counts of its scored proposals,
    P(accept j | accepted < j) shrunk toward the shared estimate with the weight of `strength`
    outcomes. Requests differ far more than match lengths do (an edit repeats its input, a
    chat answer rarely does), and every proposal is scored whether verified or not, so these
    counts carry no selection bias and fill at about one outcome a step."""

    def __init__(self, strength: float = 8.0, memory: float = 0.97) -> None:
        self.strength = strength
        self.memory = memory  # weight an outcome keeps per later one at its position
        self.accepted: list[float] = []
        self.tried: list[float] = []

    def record(self, j: int, accepted: bool) -> None:
        if j >= len(self.tried):
            grow = j + 1 - len(self.tried)
            self.tried.extend([0.0] * grow)
            self.accepted.extend([0.0] * grow)
        m = self.memory
        self.tried[j] = self.tried[j] * m + 1.0
        self.accepted[j] = self.accepted[j] * m + float(accepted)

    def adjust(self, shared: list[float]) -> list[float]:
        """The shared per-position estimates moved toward this request's own outcomes."""
        s, tried, acc = self.strength, self.tried, self.accepted
        return [
            (acc[j] + s * p) / (tried[j] + s) if j < len(tried) else p for j, p in enumerate(shared)
        ]


# a request's kind: how many of its latest output tokens (COPY_WINDOW) end an n-gram of
# COPY_N tokens seen before in it, from COPY_MIN of them on, in COPY_LEVELS steps
COPY_WINDOW = 16
COPY_MIN = 4
COPY_LEVELS = 4
COPY_N = 3


@dataclass
class _Pending:
    """A proposal whose outcome is not all known: scored against the request's tokens as they
    arrive, position by position until the first miss."""

    start: int  # the position tokens[0] was proposed for
    tokens: list[int]
    match_len: int
    kind: int
    stats: MatchStats  # where its outcomes are counted
    decided: int = 0  # positions scored so far (all hits)


@dataclass
class _Context:
    """One request's tokens, where each n-gram last occurred, and its undecided proposals."""

    owner: Request
    tokens: list[int] = field(default_factory=list)
    # last[n - min_n]: n-gram -> the position after its latest occurrence that has a follower
    last: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    rates: RequestRates = field(default_factory=RequestRates)
    # per latest output token: whether the n-gram it ends had occurred before
    copied: deque[bool] = field(default_factory=lambda: deque(maxlen=COPY_WINDOW))

    def kind(self) -> int:
        """0 until `COPY_MIN` output tokens are known, then 1 + how much of the latest output
        repeats earlier n-grams, in `COPY_LEVELS` steps."""
        seen = len(self.copied)
        if seen < COPY_MIN:
            return 0
        return 1 + min(COPY_LEVELS * sum(self.copied) // seen, COPY_LEVELS - 1)


class NgramDrafter:
    """Prompt lookup decoding (vLLM's ngram proposer): the longest suffix of the request's
    known tokens, of length `max_n` down to `min_n`, that occurred earlier in them; the draft
    is what followed its latest earlier occurrence. A match that runs into the suffix itself
    (a repeating pattern) continues with its own period.

    Outcomes are counted by the request's kind as well as the match length: a request whose
    latest output repeats n-grams of its prompt or output (an edit under way) continues a
    short match far more often than one whose output is new (a chat answer), and this shows
    in its tokens before it has drafted at all.

    Each request keeps an index, one dict per n-gram length from n-gram to its latest position,
    extended by the tokens that arrived since the last proposal (`indexed` counts that work),
    so a proposal costs `max_n - min_n + 1` lookups however long the context. It is dropped in
    `finished`, and rebuilt when the request is seen with fewer tokens than indexed or a
    different last indexed token (its output replaced), or as another request object under
    the same id.

    Outcomes: every proposal is scored against the tokens the request then produces, position
    by position up to its first miss, into `stats` and the request's own `RequestRates`, which
    move its confidences toward its own acceptance. A position the step did not verify is
    decided by the token the target produced there, which has the outcome verification would
    have had (greedy: the same token; sampled: the point-mass draft's acceptance probability,
    p(token)). So the counts need not know how many tokens the policy verified, and a
    confidence the policy stopped verifying still learns (no selection bias)."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 5, stats: MatchStats | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram lengths need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self.stats = stats or MatchStats()
        self.indexed = 0  # tokens ever added to a request's index (rebuilds included)
        self._contexts: dict[str, _Context] = {}

    def tokens(self, req: Request) -> list[int]:
        """The request's known tokens, with its index brought up to date (do not modify)."""
        return self._sync(req).tokens

    def propose(self, req: Request, k: int) -> LookupDraft:
        ctx = self._sync(req)
        if k <= 0:
            return LookupDraft([], [])
        tokens = ctx.tokens
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = ctx.last[n - self.min_n].get(tuple(tokens[end - n :]))
            if start is None:
                continue
            draft = tokens[start : start + k]
            period = end - start
            while len(draft) < k:  # the match overlaps the suffix: the pattern repeats
                draft.append(draft[len(draft) - period])
            kind = ctx.kind()
            confidence = ctx.rates.adjust(self.stats.confidence(n, len(draft), kind))
            proposal = LookupDraft(draft, confidence, source="ngram", match_len=n, kind=kind)
            self._track(ctx, proposal, self.stats)
            return proposal
        return LookupDraft([], [])

    def track(self, req: Request, draft: LookupDraft, stats: MatchStats) -> None:
        """Scores another drafter's proposal for `req`, made from its current tokens, into
        `stats` as the request's tokens arrive (how `SuffixDrafter` learns)."""
        self._track(self._sync(req), draft, stats)

    def observe(self, req: Request, draft: Draft, accepted: int) -> None:
        """The outcome shows in the request's tokens: scores its proposals on what arrived."""
        ctx = self._contexts.get(req.request_id)
        if ctx is not None and ctx.owner is req:
            self._sync(req)

    def finished(self, req: Request) -> None:
        ctx = self._contexts.get(req.request_id)
        if ctx is not None and ctx.owner is req:
            self._sync(req)  # the last tokens decide what is still pending
        self._contexts.pop(req.request_id, None)

    @staticmethod
    def _track(ctx: _Context, draft: LookupDraft, stats: MatchStats) -> None:
        if not draft.tokens:
            return
        start = len(ctx.tokens)
        # proposed again before any token arrived (an overlapped step): count it once
        ctx.pending = [p for p in ctx.pending if p.start != start or p.stats is not stats]
        ctx.pending.append(_Pending(start, list(draft.tokens), draft.match_len, draft.kind, stats))

    @staticmethod
    def _score(ctx: _Context) -> None:
        tokens, end = ctx.tokens, len(ctx.tokens)
        undecided = []
        for p in ctx.pending:
            hit, j, last = True, p.decided, min(len(p.tokens), end - p.start)
            while hit and j < last:
                hit = tokens[p.start + j] == p.tokens[j]
                p.stats.record(p.match_len, j, hit, p.kind)
                ctx.rates.record(j, hit)
                j += 1
            p.decided = j
            if hit and j < len(p.tokens):
                undecided.append(p)
        ctx.pending = undecided

    def _sync(self, req: Request) -> _Context:
        ctx = self._contexts.get(req.request_id)
        known = req.num_known_tokens
        if (
            ctx is None
            or ctx.owner is not req
            or known < len(ctx.tokens)
            # the last indexed token changed: the output was replaced
            or (ctx.tokens and req.token_at(len(ctx.tokens) - 1) != ctx.tokens[-1])
        ):
            ctx = _Context(req, [], [{} for _ in range(self.min_n, self.max_n + 1)])
            self._contexts[req.request_id] = ctx
        old = len(ctx.tokens)
        if old == known:
            return ctx
        prompt = req.prompt_ids
        if old < len(prompt):
            ctx.tokens.extend(prompt[old:])
        ctx.tokens.extend(req.output_ids[max(0, old - len(prompt)) :])
        self._index(ctx, old)
        if ctx.pending:
            self._score(ctx)
        return ctx

    def _index(self, ctx: _Context, old: int) -> None:
        """Adds the n-grams followed by the tokens from position `old` on, and notes of each
        output token whether the n-gram it ends had occurred before (the request's kind)."""
        tokens = ctx.tokens
        end = len(tokens)
        self.indexed += end - old
        prompt = min(len(ctx.owner.prompt_ids), end)
        if prompt - old > 4:  # a prompt's many tokens: in bulk
            self._index_bulk(ctx, old, prompt)
            old = prompt
        copy_n = min(max(COPY_N, self.min_n), self.max_n)
        grams = ctx.last[copy_n - self.min_n]
        for p in range(max(old, self.min_n), end):  # a decode step's few tokens
            for n, last in zip(range(self.min_n, min(p, self.max_n) + 1), ctx.last):
                last[tuple(tokens[p - n : p])] = p
            if p >= prompt and p + 1 >= copy_n:  # the n-gram ending at p: did one end before?
                ctx.copied.append(tuple(tokens[p + 1 - copy_n : p + 1]) in grams)

    def _index_bulk(self, ctx: _Context, old: int, end: int) -> None:
        tokens = ctx.tokens
        for n, last in zip(range(self.min_n, self.max_n + 1), ctx.last):
            first = max(old, n)  # the first follower position with a whole n-gram before it
            if first >= end:
                continue
            # the n-grams ending at first-1 .. end-2, built in C by zipping shifted slices;
            # later positions overwrite earlier ones, so each keeps its latest occurrence
            grams = zip(*(tokens[first - n + i : end - n + i] for i in range(n)))
            last.update(zip(grams, range(first, end)))
