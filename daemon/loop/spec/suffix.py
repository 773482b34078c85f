"""Suffix decoding (arXiv 2411.04975): drafts from what followed the same context in recent
finished requests, as agent loops repeat earlier outputs, beside the request's own lookup."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from daemon.loop.spec.ngram import LookupDraft, MatchStats, NgramDrafter

if TYPE_CHECKING:
    from daemon.loop.request import Request
    from daemon.loop.spec.base import Draft

SEP = -1  # between requests in the corpus: matches no token, so matches stop there


@dataclass
class SuffixMatch:
    """A continuation found in the index, with how many occurrences agreed on each token."""

    tokens: list[int]
    support: list[int]  # per position: the matched occurrences that continue with this token
    total: list[int]  # per position: the matched occurrences still agreeing that continue at all
    match_len: int  # the context the occurrences share with the query (tokens)


class SuffixIndex:
    """The tokens of recent finished requests (prompt then output), bounded to the latest
    `max_requests` requests and `max_tokens` tokens; the oldest request is evicted first.

    The structure is a set of hash chains over one token array, as zlib's LZ77 matcher keeps:
    the requests' tokens in arrival order, each followed by `SEP`; `head` maps every `key_n`
    tokens to the latest position that follows them and `prev[p]` links a position to the
    previous one that follows the same `key_n` tokens. Adding a request is one dict update and
    one link per token; evicting the oldest is one dict check per token, since a head that
    points into the oldest request has its whole chain there (chains only go back in time);
    memory is one link per token plus one dict entry per distinct key. A query walks the
    latest `max_candidates` occurrences of its last `key_n` tokens, extends each backwards
    to the context it shares (up to `max_n` tokens), keeps those sharing the longest, and
    drafts position by position the token most of them continue with: the count is the
    confidence's evidence. A suffix tree or automaton finds longest matches without a walk,
    but takes no deletions, which the bounded window needs; per-length n-gram tables would
    take one dict entry per token and length."""

    def __init__(
        self,
        key_n: int = 3,
        max_n: int = 8,
        max_requests: int = 256,
        max_tokens: int = 1 << 18,
        max_candidates: int = 32,
    ) -> None:
        if not 1 <= key_n <= max_n:
            raise ValueError(f"the suffix index needs 1 <= key_n <= max_n ({key_n}, {max_n})")
        if max_requests < 1 or max_tokens < 1 or max_candidates < 1:
            raise ValueError("the suffix index needs room for a request, a token, a candidate")
        self.key_n = key_n
        self.max_n = max_n
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.max_candidates = max_candidates
        self.num_tokens = 0  # the live requests' tokens
        self.indexed = 0  # tokens ever added
        # the corpus from absolute position `_base` on; `_tokens[0]` is always a separator, so
        # a backwards extension stops before the array's start
        self._tokens: list[int] = [SEP]
        self._prev: list[int] = [-1]
        self._base = 0
        self._live = 1  # the first position of the oldest live request
        self._head: dict[tuple[int, ...], int] = {}
        self._requests: deque[tuple[int, int]] = deque()  # (start, end) of each live request

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def add(self, tokens: list[int]) -> None:
        """Indexes a finished request's tokens (its last `max_tokens`), evicting the oldest
        requests beyond the bounds."""
        tokens = tokens[-self.max_tokens :]
        if not tokens:
            return
        n, head, prev = self.key_n, self._head, self._prev
        start = self._base + len(self._tokens)
        self._tokens.extend(tokens)
        self._tokens.append(SEP)
        prev.extend([-1] * min(n, len(tokens)))
        if len(tokens) > n:
            grams = zip(*(tokens[i : len(tokens) - n + i] for i in range(n)))
            for p, key in enumerate(grams, start + n):
                prev.append(head.get(key, -1))
                head[key] = p
        prev.append(-1)
        self._requests.append((start, start + len(tokens)))
        self.num_tokens += len(tokens)
        self.indexed += len(tokens)
        while len(self._requests) > self.max_requests or self.num_tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        start, end = self._requests.popleft()
        n, head, base, corpus = self.key_n, self._head, self._base, self._tokens
        lo, hi = start - base, end - base
        if hi - lo > n:
            grams = zip(*(corpus[lo + i : hi - n + i] for i in range(n)))
            for p, key in enumerate(grams, start + n):
                if head.get(key) == p:
                    del head[key]
        self.num_tokens -= end - start
        self._live = end + 1
        dead = self._live - 1 - self._base  # keep the separator before the oldest request
        if dead > len(corpus) // 2:
            del corpus[:dead]
            del self._prev[:dead]
            self._base += dead

    def query(self, context: list[int], k: int) -> SuffixMatch | None:
        """Up to `k` tokens that followed the longest shared end of `context` in the index."""
        n = self.key_n
        if k <= 0 or len(context) < n:
            return None
        corpus, prev, base, live = self._tokens, self._prev, self._base, self._live
        limit = min(self.max_n, len(context))
        found: list[tuple[int, int]] = []  # (shared length, position after it), latest first
        p = self._head.get(tuple(context[-n:]), -1)
        while p >= live and len(found) < self.max_candidates:
            i = p - base
            shared = n
            while shared < limit and corpus[i - shared - 1] == context[-shared - 1]:
                shared += 1
            found.append((shared, p))
            p = prev[i]
        if not found:
            return None
        best = max(shared for shared, _ in found)
        alive = [p - base for shared, p in found if shared == best]
        draft, support, total = [], [], []
        for j in range(k):
            counts: dict[int, int] = {}
            for i in alive:
                token = corpus[i + j]
                if token != SEP:
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # ties: the latest occurrence's
            draft.append(token)
            support.append(counts[token])
            total.append(sum(counts.values()))
            alive = [i for i in alive if corpus[i + j] == token]
        return SuffixMatch(draft, support, total, best)


def expected_accepted(confidence: list[float]) -> float:
    """The expected accepted length of a draft: the sum of its survival probabilities."""
    total, survival = 0.0, 1.0
    for c in confidence:
        survival *= c
        total += survival
    return total


class SuffixDrafter:
    """Suffix decoding: the index's continuation of the request's last tokens, or the
    request's own prompt lookup (`NgramDrafter`), whichever expects more accepted tokens.

    An index draft's confidence at position j is its evidence, the `support` of the `total`
    occurrences still agreeing, weighed against the observed acceptance of index drafts of its
    match length at j (`stats`, worth `strength` occurrences): (support + w q) / (total + w).
    Index drafts are scored against the request's tokens as its own are (`NgramDrafter.track`).
    A finished request's prompt and output go into the index."""

    name = "suffix"

    def __init__(
        self,
        index: SuffixIndex | None = None,
        own: NgramDrafter | None = None,
        stats: MatchStats | None = None,
        strength: float = 2.0,
    ) -> None:
        self.index = index or SuffixIndex()
        self.own = own or NgramDrafter()
        self.stats = stats or MatchStats()
        self.strength = strength

    def propose(self, req: Request, k: int) -> LookupDraft:
        own = self.own.propose(req, k)
        match = self.index.query(self.own.tokens(req), k)
        if match is None:
            return own
        w = self.strength
        observed = self.stats.confidence(match.match_len, len(match.tokens))
        confidence = [
            (s + w * q) / (t + w) for s, t, q in zip(match.support, match.total, observed)
        ]
        cross = LookupDraft(match.tokens, confidence, source="suffix", match_len=match.match_len)
        # both proposals are scored, whichever is taken, so neither's statistics starve
        self.own.track(req, cross, self.stats)
        return cross if expected_accepted(confidence) > expected_accepted(own.confidence) else own

    def observe(self, req: Request, draft: Draft, accepted: int) -> None:
        """Scores the request's proposals on the tokens that arrived (`NgramDrafter.observe`)."""
        self.own.observe(req, draft, accepted)

    def finished(self, req: Request) -> None:
        self.own.finished(req)
        self.index.add(req.prompt_ids + req.output_ids)
