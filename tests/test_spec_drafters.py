"""The host drafters: prompt lookup, the suffix index across requests, their confidences."""

from __future__ import annotations

import random

import pytest

from daemon.loop.request import Request, SamplingParams
from daemon.loop.spec.drafters import build_drafter
from daemon.loop.spec.ngram import LookupDraft, MatchStats, NgramDrafter


def request(prompt: list[int], output: list[int] = (), rid: str = "r") -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=64))
    req.output_ids.extend(output)
    return req


def rescan(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """Prompt lookup by brute force: the reference the incremental index must equal."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        for start in range(end - 1, n - 1, -1):
            if tokens[start - n : start] == tokens[end - n :]:
                draft = tokens[start : start + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (end - start)])
                return draft, n
    return [], 0


def test_a_repeat_proposes_what_followed_it() -> None:
    d = NgramDrafter(min_n=2, max_n=4)
    # ... 5 6 7 8 9 10 ... 5 6 7 -> 8 9 10 11
    draft = d.propose(request([1, 5, 6, 7, 8, 9, 10, 11, 12, 2, 5, 6, 7]), 4)
    assert draft.tokens == [8, 9, 10, 11]
    assert draft.match_len == 3 and draft.source == "ngram"
    assert len(draft.confidence) == 4 and all(0.0 < c < 1.0 for c in draft.confidence)
    assert draft.probs is None


def test_no_match_proposes_nothing() -> None:
    d = NgramDrafter(min_n=2, max_n=4)
    assert d.propose(request([1, 2, 3, 4, 5, 6]), 5).tokens == []
    assert d.propose(request([7], rid="short"), 5).tokens == []
    # a single repeated token is below min_n
    assert d.propose(request([1, 2, 3, 9, 4, 5, 9], rid="one"), 5).tokens == []


def test_the_longest_match_wins_then_the_latest() -> None:
    d = NgramDrafter(min_n=1, max_n=4)
    # "3 4" occurs twice, followed by 50 then 60; "2 3 4" only before 50: the longer match wins
    draft = d.propose(request([2, 3, 4, 50, 9, 3, 4, 60, 9, 2, 3, 4]), 2)
    assert (draft.tokens, draft.match_len) == ([50, 9], 3)
    # two equally long matches: the latest
    draft = d.propose(request([3, 4, 50, 3, 4, 60, 3, 4], rid="b"), 1)
    assert (draft.tokens, draft.match_len) == ([60], 2)


def test_overlapping_matches_continue_the_pattern() -> None:
    d = NgramDrafter(min_n=2, max_n=4)
    # a period-2 loop: the latest earlier "1 2 1 2" is followed by the suffix itself
    draft = d.propose(request([9, 1, 2, 1, 2, 1, 2]), 5)
    assert draft.tokens == [1, 2, 1, 2, 1]
    draft = d.propose(request([5, 7, 7, 7], rid="b"), 4)
    assert draft.tokens == [7, 7, 7, 7]


def test_k_limits_the_draft() -> None:
    d = NgramDrafter(min_n=2, max_n=3)
    req = request(list(range(20)) + [0, 1])
    assert d.propose(req, 3).tokens == [2, 3, 4]
    assert d.propose(req, 1).tokens == [2]
    assert d.propose(req, 0).tokens == []
    assert len(d.propose(req, 7).confidence) == 7


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_updates_equal_a_rescan(seed: int) -> None:
    rng = random.Random(seed)
    d = NgramDrafter(min_n=1, max_n=5)
    prompt = [rng.randrange(6) for _ in range(40)]
    req = request(prompt)
    for step in range(150):
        k = rng.randrange(1, 7)
        draft = d.propose(req, k)
        want, n = rescan(req.prompt_ids + req.output_ids, k, 1, 5)
        assert (draft.tokens, draft.match_len) == (want, n), step
        # several tokens may arrive between proposals (an accepted draft)
        req.output_ids.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))
    d.propose(req, 1)
    assert d.indexed == req.num_known_tokens  # each token indexed once: no rescan per step


def test_the_index_work_is_the_new_tokens_only() -> None:
    d = NgramDrafter()
    req = request(list(range(3000)))
    d.propose(req, 5)
    assert d.indexed == 3000
    for t in range(100):
        req.output_ids.append(t % 7)
        d.propose(req, 5)
    assert d.indexed == 3100


def test_fewer_tokens_than_indexed_rebuilds() -> None:
    d = NgramDrafter(min_n=2, max_n=3)
    req = request([1, 2, 3, 4], [1, 2])
    assert d.propose(req, 2).tokens == [3, 4]
    req.output_ids[:] = [4]  # fewer tokens than indexed: rebuilt from the request
    assert d.propose(req, 2).tokens == []
    req.output_ids[:] = [1, 2, 3]  # the last indexed token changed: rebuilt
    assert d.propose(req, 2).tokens == [4, 1]
    assert d.indexed == 6 + 5 + 7
    # another request object under the same id is indexed afresh
    assert d.propose(request([5, 6, 7, 5, 6]), 1).tokens == [7]


def test_finished_drops_the_index() -> None:
    d = NgramDrafter()
    req = request([1, 2, 3, 1, 2])
    d.propose(req, 2)
    d.finished(req)
    assert d._contexts == {}
    d.finished(req)  # twice is harmless


def test_confidence_moves_with_observed_acceptance() -> None:
    d = NgramDrafter(min_n=2, max_n=4)
    long_match = request([1, 5, 6, 7, 8, 9, 10, 11, 12, 2, 5, 6, 7])
    short_match = request([1, 2, 3, 4, 5, 6, 9, 9, 5, 6], rid="s")
    before_long = d.propose(long_match, 4).confidence
    before_short = d.propose(short_match, 4).confidence
    assert before_long == before_short  # no evidence yet: the prior

    for _ in range(60):
        d.observe(long_match, d.propose(long_match, 4), 4)  # all accepted
        short = d.propose(short_match, 4)
        d.observe(short_match, short, 1)  # the second rejected
    after_long = d.propose(long_match, 4).confidence
    after_short = d.propose(short_match, 4).confidence
    assert all(a > b + 0.3 for a, b in zip(after_long, before_long))
    assert after_short[0] > before_short[0] + 0.3  # position 0: always accepted
    assert after_short[1] < 0.2  # position 1: always rejected
    # position 2 was never verified for short matches: it follows its position's pool
    assert after_short[2] > before_short[2]


def test_match_stats_are_conditional_and_bounded() -> None:
    stats = MatchStats(prior=0.5, strength=4.0, window=100.0)
    assert stats.confidence(3, 2) == [0.5, 0.5]
    for _ in range(1000):
        stats.observe(3, verified=3, accepted=1)  # 0 accepted, 1 rejected, 2 not reached
    rates = stats.confidence(3, 3)
    assert rates[0] > 0.95 and rates[1] < 0.05 and rates[2] == pytest.approx(0.5)
    # the window keeps the counts bounded, so a change of regime shows quickly
    for _ in range(200):
        stats.observe(3, verified=2, accepted=2)
    assert stats.confidence(3, 2)[1] > 0.8
    assert stats.confidence(3, 0) == []


def test_observe_wants_a_lookup_draft() -> None:
    d = NgramDrafter()
    with pytest.raises(TypeError):
        from daemon.loop.spec.base import Draft

        d.observe(request([1]), Draft([1], [0.5]), 1)
    d.observe(request([1]), LookupDraft([], []), 0)


def test_build_drafter_by_name() -> None:
    assert isinstance(build_drafter("ngram", 5), NgramDrafter)
    assert build_drafter("ngram", 5).name == "ngram"
    with pytest.raises(ValueError, match="unknown drafter 'eagle'.*ngram"):
        build_drafter("eagle", 5)
    with pytest.raises(ValueError, match="k >= 1"):
        build_drafter("ngram", 0)
