"""The host drafters: prompt lookup, the suffix index across requests, their confidences."""

from __future__ import annotations

import random
from collections import deque

import pytest

from daemon.loop.request import Request, SamplingParams
from daemon.loop.spec.drafters import build_drafter
from daemon.loop.spec.ngram import COPY_LEVELS, COPY_MIN, COPY_WINDOW, MatchStats, NgramDrafter
from daemon.loop.spec.suffix import SuffixDrafter, SuffixIndex, SuffixMatch, expected_accepted


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


def copy_kind(tokens: list[int], prompt_len: int, copy_n: int = 3) -> int:
    """A request's kind by brute force: of its latest output tokens, the share that end an
    n-gram which ended somewhere before."""
    marks = [
        any(
            tokens[q + 1 - copy_n : q + 1] == tokens[p + 1 - copy_n : p + 1]
            for q in range(copy_n - 1, p)
        )
        for p in range(max(prompt_len, copy_n - 1), len(tokens))
    ][-COPY_WINDOW:]
    if len(marks) < COPY_MIN:
        return 0
    return 1 + min(COPY_LEVELS * sum(marks) // len(marks), COPY_LEVELS - 1)


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
        if draft.tokens:
            assert draft.kind == copy_kind(req.prompt_ids + req.output_ids, len(prompt)), step
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


def step(d: NgramDrafter | SuffixDrafter, req: Request, truth: list[int], k: int = 4) -> int:
    """One speculative step against a target that produces `truth`: propose, verify all,
    append the accepted drafts and the target's next token, report. Returns accepted."""
    draft = d.propose(req, k)
    at = req.num_known_tokens - len(req.prompt_ids)
    accepted = 0
    while accepted < len(draft.tokens) and draft.tokens[accepted] == truth[at + accepted]:
        accepted += 1
    req.output_ids.extend(truth[at : at + accepted + 1])
    d.observe(req, draft, accepted)
    return accepted


def test_confidence_moves_with_observed_acceptance() -> None:
    d = NgramDrafter(min_n=2, max_n=4)
    prior = d.stats.confidence(4, 4)
    phrase = list(range(100, 130))
    # a target that copies its prompt: every draft is accepted
    copier = request(phrase + phrase[:6])
    truth = (phrase * 20)[6:]
    while copier.num_known_tokens < 200:
        step(d, copier, truth)
    copying = d.propose(copier, 4).kind
    assert copying == COPY_LEVELS  # every output token repeats the prompt
    assert all(c > p + 0.3 for c, p in zip(d.stats.confidence(4, 4, copying), prior))
    # "1 2" always continued by something new: the first drafted token is always rejected
    fresh = iter(range(1000, 2000))
    deviating = request([1, 2, next(fresh)], rid="x")
    truth = [t for _ in range(200) for t in (1, 2, next(fresh))]
    for _ in range(60):
        step(d, deviating, truth)
    while deviating.output_ids[-2:] != [1, 2]:
        step(d, deviating, truth)
    new = d.propose(deviating, 1).kind
    assert new == 1  # no 3-gram of its output occurred before
    assert d.stats.confidence(2, 1, new)[0] < 0.2
    # position 1 of length-2 matches was never reached: it follows its position's pool
    assert d.stats.confidence(2, 2, new)[1] > prior[1]


def test_a_requests_own_acceptance_moves_its_confidence() -> None:
    """Two requests share the drafter's match statistics; one keeps repeating itself, the other
    never does what its matches predict: the same match then gets different confidences."""
    d = NgramDrafter(min_n=2, max_n=2)
    phrase = list(range(100, 110))
    copier = request(phrase + phrase[:3], rid="copier")
    truth = (phrase * 30)[3:]
    fresh = iter(range(1000, 5000))
    deviating = request([1, 2, next(fresh)], rid="deviating")
    lies = [t for _ in range(200) for t in (1, 2, next(fresh))]
    for _ in range(40):
        step(d, copier, truth, k=2)
        step(d, deviating, lies, k=2)
    while deviating.output_ids[-2:] != [1, 2]:  # where its last tokens match
        step(d, deviating, lies, k=2)
    shared = d.stats.confidence(2, 2)
    good, bad = d.propose(copier, 2), d.propose(deviating, 2)
    assert good.match_len == bad.match_len == 2
    assert good.confidence[0] > shared[0] + 0.15
    assert bad.confidence[0] < shared[0] - 0.4, (bad.confidence, shared)
    # a request with no outcomes yet gets the shared estimate
    assert d.propose(request([7, 8, 9, 7, 8], rid="new"), 2).confidence == shared


def test_unverified_positions_are_decided_by_the_tokens() -> None:
    d = NgramDrafter(min_n=2, max_n=3)
    req = request([1, 2, 3, 4, 5, 6, 1, 2, 3])
    draft = d.propose(req, 3)
    assert (draft.tokens, draft.match_len) == ([4, 5, 6], 3)
    d.propose(req, 3)  # proposed again before a token arrived: counted once
    # the policy verified none: the target's tokens arrive one a step, and score the draft
    for token in (4, 5):
        req.output_ids.append(token)
        d.observe(req, draft, 0)
    assert d.stats.outcomes == 2
    req.output_ids.append(9)  # the target did not continue with 6
    d.finished(req)  # what arrived before the end is scored
    assert d.stats.outcomes == 3
    rates = d.stats.confidence(3, 3)
    assert rates[0] > 0.5 and rates[1] > 0.5 and rates[2] < 0.5


def test_match_stats_are_conditional_and_bounded() -> None:
    stats = MatchStats(prior=0.5, strength=4.0, memory=0.99)
    assert stats.confidence(3, 2) == [0.5, 0.5]
    for _ in range(1000):
        stats.observe(3, verified=3, accepted=1)  # 0 accepted, 1 rejected, 2 not reached
    rates = stats.confidence(3, 3)
    assert rates[0] > 0.95 and rates[1] < 0.05 and rates[2] == pytest.approx(0.5)
    # old outcomes fade, so a change of regime shows quickly
    for _ in range(200):
        stats.observe(3, verified=2, accepted=2)
    assert stats.confidence(3, 2)[1] > 0.8
    assert stats.confidence(3, 0) == []


def test_match_stats_weigh_outcomes_by_their_memory() -> None:
    """Each outcome weighs memory ** (later outcomes): the estimate equals that sum computed
    directly, across the rescaling of the weights (which 0.9 reaches after ~260 outcomes)."""
    m, s = 0.9, 2.0
    stats = MatchStats(prior=0.5, strength=s, memory=m)
    rng = random.Random(0)
    ys = [rng.random() < 0.3 for _ in range(700)]
    for y in ys:
        stats.record(2, 0, y)
    acc = sum(m ** (len(ys) - 1 - i) * y for i, y in enumerate(ys))
    tried = sum(m ** (len(ys) - 1 - i) for i in range(len(ys)))
    pooled = (acc + s * 0.5) / (tried + s)
    kind = (acc + s * pooled) / (tried + s)
    assert stats.confidence(2, 1) == pytest.approx([(acc + s * kind) / (tried + s)])
    with pytest.raises(ValueError, match="memory"):
        MatchStats(memory=0.0)


def test_kinds_of_request_are_counted_apart() -> None:
    stats = MatchStats(strength=4.0)
    for _ in range(200):
        stats.record(2, 0, True, kind=4)  # copying requests: their matches continue
        stats.record(2, 0, False, kind=1)  # new text: its matches do not
    assert stats.confidence(2, 1, kind=4)[0] > 0.9
    assert stats.confidence(2, 1, kind=1)[0] < 0.1
    # a kind with no outcomes gets the rate over every kind, a length a kind has not seen
    # the kind's rate
    assert 0.3 < stats.confidence(2, 1, kind=2)[0] < 0.7
    assert stats.confidence(5, 1, kind=4)[0] > 0.9


def test_build_drafter_by_name() -> None:
    assert isinstance(build_drafter("ngram", 5), NgramDrafter)
    assert isinstance(build_drafter("suffix", 5), SuffixDrafter)
    assert build_drafter("ngram", 5).name == "ngram"
    with pytest.raises(ValueError, match="unknown drafter 'eagle'.*ngram"):
        build_drafter("eagle", 5)
    with pytest.raises(ValueError, match="k >= 1"):
        build_drafter("ngram", 0)


def test_the_suffix_index_finds_an_earlier_requests_continuation() -> None:
    d = SuffixDrafter(SuffixIndex(key_n=3, max_requests=2))
    d.finished(request([1, 2, 3], [10, 11, 12, 13, 14, 15, 16], rid="a"))
    later = request([7, 8, 10, 11, 12], rid="b")  # nothing to look up in its own tokens
    draft = d.propose(later, 6)
    assert draft.tokens == [13, 14, 15, 16]  # up to where the earlier request ended
    assert (draft.source, draft.match_len) == ("suffix", 3)
    assert all(0.0 < c < 1.0 for c in draft.confidence)
    # two more requests evict the first: its continuation is forgotten
    d.finished(request([20, 21, 22, 23], rid="c"))
    d.finished(request([30, 31, 32, 33], rid="d"))
    assert d.index.num_requests == 2
    assert d.propose(later, 6).tokens == []


def test_the_token_bound_evicts_the_oldest() -> None:
    index = SuffixIndex(key_n=2, max_tokens=10)
    index.add([1, 2, 3, 4, 5, 6])
    assert index.query([1, 2], 3) == SuffixMatch([3, 4, 5], [1, 1, 1], [1, 1, 1], 2)
    index.add([7, 8, 9, 10, 11])  # 11 tokens: the first request goes
    assert (index.num_requests, index.num_tokens) == (1, 5)
    assert index.query([1, 2], 3) is None
    assert index.query([8, 9], 3).tokens == [10, 11]
    index.add(list(range(100, 130)))  # longer than the bound: its last 10 tokens are kept
    assert (index.num_requests, index.num_tokens) == (1, 10)
    assert index.query([120, 121], 2).tokens == [122, 123]
    assert index.query([100, 101], 2) is None
    assert index.indexed == 6 + 5 + 10  # each request's tokens indexed once


def test_the_longest_shared_context_wins_then_the_majority() -> None:
    index = SuffixIndex(key_n=2, max_n=6)
    index.add([6, 1, 2, 3, 50, 51])
    index.add([5, 1, 2, 3, 40, 41])  # the latest, but it shares less with the query
    match = index.query([9, 6, 1, 2, 3], 2)
    assert (match.tokens, match.match_len) == ([50, 51], 4)
    # equally long contexts: position by position the token most of them continue with
    for tail in ([7, 8], [7, 9], [4, 4]):
        index.add([0, 1, 2, 3, *tail])
    match = index.query([1, 2, 3], 3)
    assert match == SuffixMatch([7, 9], [2, 1], [5, 2], 3)  # 8 or 9 (a tie): the latest


def test_suffix_confidence_counts_agreeing_occurrences() -> None:
    def first_confidence(continuations: list[int]) -> float:
        d = SuffixDrafter(SuffixIndex(key_n=3))
        for i, token in enumerate(continuations):
            d.finished(request([1, 2, 3, token], rid=str(i)))
        draft = d.propose(request([8, 1, 2, 3], rid="q"), 1)
        assert draft.source == "suffix"
        return draft.confidence[0]

    one, three, split = (
        first_confidence([4]),
        first_confidence([4, 4, 4]),
        first_confidence([4, 5, 4]),
    )
    assert split < one < three


def test_suffix_confidence_moves_with_observed_acceptance() -> None:
    d = SuffixDrafter(SuffixIndex(key_n=3))
    d.finished(request([1, 2, 3, 4, 5, 6, 7], rid="a"))
    before = d.propose(request([9, 2, 3, 4], rid="probe"), 3)
    assert before.source == "suffix"
    for i in range(30):  # later requests never continue "2 3 4" with 5
        step(d, request([9, 2, 3, 4], rid=str(i)), [100 + i, 0])
    after = d.propose(request([9, 2, 3, 4], rid="probe2"), 3)
    assert after.confidence[0] < before.confidence[0] - 0.2
    assert d.own.stats.outcomes == 0  # the lookup's own statistics untouched


def test_the_better_scored_proposal_is_taken() -> None:
    d = SuffixDrafter(SuffixIndex(key_n=2))
    d.finished(request([1, 2, 3, 30, 31], rid="a"))
    # its own tokens repeat "1 2 3" too, followed by 4 5 6
    req = request([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], rid="b")
    draft = d.propose(req, 2)
    assert (draft.source, draft.tokens) == ("suffix", [30, 31])  # 1 occurrence beats the prior
    for _ in range(50):
        d.own.stats.observe(3, verified=2, accepted=2)  # own matches of length 3: accepted
    draft = d.propose(req, 2)
    assert (draft.source, draft.tokens) == ("ngram", [4, 5])
    assert expected_accepted(draft.confidence) > 1.5
    # both proposals are scored against what the target produced
    req.output_ids.extend([4, 5])
    d.finished(req)
    assert (d.own.stats.outcomes, d.stats.outcomes) == (100 + 2, 1)
    assert d.own._contexts == {} and d.index.num_requests == 2


def test_expected_accepted_is_the_sum_of_survivals() -> None:
    assert expected_accepted([]) == 0.0
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)


def reference_query(
    live: deque[list[int]], context: list[int], k: int, key_n: int, max_n: int
) -> SuffixMatch | None:
    """The index's query by brute force over the live requests."""
    found = []
    for r, doc in enumerate(live):
        for i in range(key_n, len(doc)):
            if doc[i - key_n : i] == context[-key_n:]:
                shared = key_n
                limit = min(max_n, len(context))
                while shared < limit and shared < i and doc[i - shared - 1] == context[-shared - 1]:
                    shared += 1
                found.append((r, i, shared))
    if not found:
        return None
    best = max(f[2] for f in found)
    alive = sorted(((r, i) for r, i, shared in found if shared == best), reverse=True)
    tokens, support, total = [], [], []
    for j in range(k):
        counts: dict[int, int] = {}
        for r, i in alive:
            if i + j < len(live[r]):
                counts[live[r][i + j]] = counts.get(live[r][i + j], 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)
        tokens.append(token)
        support.append(counts[token])
        total.append(sum(counts.values()))
        alive = [(r, i) for r, i in alive if i + j < len(live[r]) and live[r][i + j] == token]
    return SuffixMatch(tokens, support, total, best)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_suffix_index_equals_a_brute_force_search(seed: int) -> None:
    rng = random.Random(seed)
    index = SuffixIndex(key_n=2, max_n=5, max_requests=5, max_tokens=60, max_candidates=10**6)
    live: deque[list[int]] = deque()
    for _ in range(300):
        doc = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        index.add(doc)
        if doc[-60:]:
            live.append(doc[-60:])
        while len(live) > 5 or sum(map(len, live)) > 60:
            live.popleft()
        assert index.num_tokens == sum(map(len, live))
        for _ in range(3):
            context = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
            k = rng.randrange(1, 6)
            assert index.query(context, k) == reference_query(live, context, k, 2, 5)
    # evicted requests leave nothing behind: the corpus and the heads stay bounded
    assert len(index._tokens) <= 2 * (60 + 5) + 2
    assert len(index._head) <= 60
