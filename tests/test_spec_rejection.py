"""Verification of drafts (daemon/loop/spec/rejection.py): greedy output as argmax decoding, and
sampled output distributed as the target's (chi-square on a tiny vocabulary, point-mass and
model drafts, one and two tokens), seeded rows, batches mixing drafting and plain rows."""

from __future__ import annotations

import math

import pytest
import torch

from daemon.loop.request import SamplingParams
from daemon.loop.sampler import SamplingBatch, sample
from daemon.loop.spec.rejection import verify
from kernels import sampling_cpu

V = 8
GREEDY = SamplingParams(temperature=0.0)
# temperature, top-k, top-p and min-p: each cuts or reshapes the target on the logits below
WARPS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
]


def batch(params: list[SamplingParams], indices: list[int], vocab: int = V) -> SamplingBatch:
    return SamplingBatch.build(params, indices, vocab)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def target(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The warped distribution from its definitions: softmax at the temperature, the top_k most
    likely, those before which less than top_p of the mass lies, those at min_p x the max."""
    probs = (logits / p.temperature).softmax(-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(probs.argsort(descending=True).tolist()):
        if (p.top_k and rank >= p.top_k) or mass >= p.top_p:
            break
        keep[token] = True
        mass += float(probs[token])
    keep &= probs >= p.min_p * probs.max()
    kept = probs * keep
    return kept / kept.sum()


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether counts fit probs at the 0.05 % level; a token of probability 0 never appears."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if bool((counts[probs == 0] > 0).any()):
        return False
    n, live = counts.sum(), probs > 0
    expected = n * probs[live]
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    df = int(live.sum()) - 1
    z = 3.29  # the normal quantile at 1 - 0.0005 (Wilson-Hilferty for the chi-square's)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def test_greedy_accepts_the_argmax_prefix_and_then_emits_the_argmax() -> None:
    vocab, k = 50, 4
    per_seq = [torch.randn(k + 1, vocab, generator=gen(s)) for s in range(5)]
    argmax = [rows.argmax(-1).tolist() for rows in per_seq]
    wrong = [[(t + 1) % vocab for t in a[:k]] for a in argmax]
    drafts = [
        argmax[0][:k],  # fully right: k accepted and the bonus row's argmax
        wrong[1],  # fully wrong: the first row's argmax
        argmax[2][:2] + [wrong[2][2], argmax[2][3]],  # right again after a wrong one: stops
        [],  # no draft: one decode row
        argmax[4][:1] + wrong[4][1:],  # with a draft distribution: greedy all the same
    ]
    logits = torch.cat([rows[: len(d) + 1] for rows, d in zip(per_seq, drafts)])
    q = torch.full((k, vocab), 1.0 / vocab)
    params = [GREEDY, GREEDY, SamplingParams(top_k=1), GREEDY, GREEDY]
    out = verify(logits, drafts, [None] * 4 + [q], batch(params, [3] * 5, vocab), gen(0))
    assert out.num_accepted == [4, 0, 2, 0, 1]
    for a, n, tokens in zip(argmax, out.num_accepted, out.tokens):
        assert tokens == a[: n + 1]  # what argmax decoding emits, one token per row
    assert out.rows == [[0, 1, 2, 3, 4], [5], [10, 11, 12], [15], [16, 17]]


def test_without_drafts_it_is_sample() -> None:
    vocab = 1000
    logits = 3 * torch.randn(6, vocab, generator=gen(1))
    params = [*WARPS, GREEDY, SamplingParams(seed=5)]
    sb = batch(params, [0, 1, 2, 3, 4, 9], vocab)
    out = verify(logits, [[]] * 6, [None] * 6, sb, gen(2))
    assert [t[0] for t in out.tokens] == sample(logits, sb, gen(2)).tokens.tolist()
    assert out.num_accepted == [0] * 6 and out.rows == [[i] for i in range(6)]


def plain_decode(rows: torch.Tensor, p: SamplingParams, first: int) -> list[int]:
    """A seeded request decoded one token a step (row j: output index first + j)."""
    vocab = rows.shape[1]
    return [
        sample(rows[j : j + 1].clone(), batch([p], [first + j], vocab), gen(j)).tokens.item()
        for j in range(rows.shape[0])
    ]


def test_seeded_point_mass_drafts_give_the_tokens_of_plain_decoding() -> None:
    vocab = 1000
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    # a peaked target, so that drafts taken from plain decoding are likely to be right too
    rows = 6 * torch.randn(4, vocab, generator=gen(3))
    plain = plain_decode(rows, seeded, 5)
    alone = verify(rows, [plain[:3]], [None], batch([seeded], [5], vocab), gen(0))
    assert alone.tokens == [plain] and alone.num_accepted == [3]
    wrong = [plain[0], (plain[1] + 1) % vocab, plain[2]]
    stopped = verify(rows, [wrong], [None], batch([seeded], [5], vocab), gen(1))
    assert stopped.tokens == [plain[:2]]
    # among other sequences, at another place in the batch, with another generator
    other = torch.randn(3, vocab, generator=gen(4))
    logits = torch.cat([other, rows])
    sb = batch([SamplingParams(), seeded], [0, 5], vocab)
    mixed = verify(logits, [[1, 2], plain[:3]], [None, None], sb, gen(9))
    assert mixed.tokens[1] == plain and mixed.rows[1] == [3, 4, 5, 6]


def test_seeded_rows_with_draft_distributions_reproduce() -> None:
    seeded = SamplingParams(temperature=1.0, top_k=6, seed=11)
    rows = torch.randn(4, V, generator=gen(5))
    q = torch.randn(3, V, generator=gen(6)).softmax(-1)
    draft = torch.multinomial(q, 1, generator=gen(7)).squeeze(1).tolist()
    alone = verify(rows, [draft], [q], batch([seeded], [2]), gen(0))
    logits = torch.cat([torch.randn(2, V, generator=gen(8)), rows])
    sb = batch([SamplingParams(seed=3), seeded], [0, 2])
    q_other = torch.full((1, V), 1.0 / V)
    for g in (1, 2, 3):
        mixed = verify(logits, [[4], draft], [q_other, q], sb, gen(g))
        assert mixed.tokens[1] == alone.tokens[0]
    outcomes = {
        tuple(verify(rows, [draft], [q], batch([seeded], [i]), gen(0)).tokens[0]) for i in range(20)
    }
    assert len(outcomes) > 1  # the output index moves the stream


def test_a_seeded_row_is_decided_by_its_own_output_index() -> None:
    """Verifying [a, b] at output index 2 and, once a is taken, [b] at index 3 decide b alike:
    each row draws from its own index's stream, however the drafts are split into steps."""
    rows = torch.randn(3, V, generator=gen(70))
    q = torch.randn(2, V, generator=gen(71)).softmax(-1)
    draft = [int(rows[0].argmax()), int(rows[1].argsort()[V // 2])]  # b: often rejected
    compared, rejected = 0, 0
    for seed in range(40):
        p = SamplingParams(temperature=1.0, seed=seed)
        both = verify(rows, [draft], [q], batch([p], [2]), gen(0))
        if both.num_accepted[0] >= 1:
            second = verify(rows[1:], [draft[1:]], [q[1:]], batch([p], [3]), gen(1))
            assert second.tokens[0] == both.tokens[0][1:]
            compared += 1
            rejected += both.num_accepted[0] == 1
    assert compared > 5 and 0 < rejected < compared


def test_a_mixed_batch_decides_each_sequence_as_alone() -> None:
    vocab = 64
    seeded = SamplingParams(temperature=0.9, seed=21)
    seeded_q = SamplingParams(temperature=1.1, top_p=0.9, seed=22)
    per_seq = [4 * torch.randn(4, vocab, generator=gen(10 + s)) for s in range(5)]
    greedy_argmax = per_seq[0].argmax(-1).tolist()
    plain = plain_decode(per_seq[1], seeded, 4)
    q = torch.randn(2, vocab, generator=gen(20)).softmax(-1)
    drafts = [
        greedy_argmax[:2] + [(greedy_argmax[2] + 1) % vocab],  # greedy, drafting
        plain[:3],  # seeded sampled, point-mass drafts
        [],  # seeded sampled, no draft
        [3, 9],  # seeded sampled, model drafts
        [],  # greedy, no draft
    ]
    probs = [None, None, None, q, None]
    params = [GREEDY, seeded, seeded, seeded_q, GREEDY]
    indices = [0, 4, 7, 1, 0]
    logits = torch.cat([rows[: len(d) + 1] for rows, d in zip(per_seq, drafts)])
    out = verify(logits, drafts, probs, batch(params, indices, vocab), gen(30))
    assert out.tokens[0] == greedy_argmax[:3] and out.num_accepted[0] == 2
    assert out.tokens[1] == plain
    assert out.tokens[2] == plain_decode(per_seq[2][:1], seeded, 7)
    alone = verify(per_seq[3][:3], [drafts[3]], [q], batch([seeded_q], [1], vocab), gen(31))
    assert out.tokens[3] == alone.tokens[0]
    assert out.tokens[4] == [per_seq[4][0].argmax().item()]
    start = 0
    for d, n, tokens, rows in zip(drafts, out.num_accepted, out.tokens, out.rows):
        assert tokens[:n] == d[:n] and rows == list(range(start, start + n + 1))
        start += len(d) + 1


def first_tokens(
    p: SamplingParams, row: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, seed: int
) -> torch.Tensor:
    """The first token each of len(draft) sequences emits: one draft token each, `row` its
    target logits (a bonus row after it), q its draft distribution or None (a point mass)."""
    n = draft.numel()
    logits = torch.stack([row, torch.zeros(V)]).repeat(n, 1)
    probs = [None if q is None else q[None]] * n
    out = verify(logits, [[t] for t in draft.tolist()], probs, batch([p] * n, [0] * n), gen(seed))
    return torch.tensor([t[0] for t in out.tokens])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("p", WARPS, ids=["t1", "top_k", "top_p", "min_p"])
def test_the_first_token_is_distributed_as_the_target(
    monkeypatch: pytest.MonkeyPatch, p: SamplingParams, kernel: bool
) -> None:
    monkeypatch.setattr(sampling_cpu, "ENABLED", kernel)  # the C++ sampler, or torch's (GPUs)
    n = 6000
    row = torch.randn(V, generator=gen(40))
    want = target(row, p)
    # point masses on every token in turn (those outside the support too)
    draft = torch.arange(n) % V
    tokens = first_tokens(p, row, draft, None, seed=41)
    assert chi_square_ok(torch.bincount(tokens, minlength=V), want)
    # drafts from a q != p, with mass where the target has none
    q = torch.randn(V, generator=gen(42)).softmax(-1)
    draft = torch.multinomial(q, n, replacement=True, generator=gen(43))
    tokens = first_tokens(p, row, draft, q, seed=44)
    assert chi_square_ok(torch.bincount(tokens, minlength=V), want)
    # the test tells: always taking the draft would give q, not the target
    assert not chi_square_ok(torch.bincount(draft, minlength=V), want)


@pytest.mark.parametrize("model_drafts", [False, True], ids=["point_mass", "draft_model"])
def test_two_emitted_tokens_are_distributed_as_p1_times_p2(model_drafts: bool) -> None:
    n = 20000
    params = SamplingParams(temperature=1.0, top_k=7)
    rows = torch.randn(3, V, generator=gen(50))  # position 1, 2 and the bonus: no draft moves them
    p1, p2 = target(rows[0], params), target(rows[1], params)
    q = torch.randn(2, V, generator=gen(51)).softmax(-1)
    if model_drafts:
        drafts = torch.stack(
            [torch.multinomial(q[j], n, True, generator=gen(52 + j)) for j in (0, 1)]
        )
    else:  # all pairs of point masses in turn
        drafts = torch.stack([torch.arange(n) % V, torch.arange(n) // V % V])
    sb = batch([params] * n, [0] * n)
    probs = [q if model_drafts else None] * n
    out = verify(rows.repeat(n, 1), drafts.T.tolist(), probs, sb, gen(53))
    # where only one token came out, the next step samples position 2 from its plain row
    short = [i for i, t in enumerate(out.tokens) if len(t) == 1]
    step = verify(
        rows[1].repeat(len(short), 1),
        [[]] * len(short),
        [None] * len(short),
        batch([params] * len(short), [1] * len(short)),
        gen(54),
    )
    for i, t in zip(short, step.tokens):
        out.tokens[i].append(t[0])
    pairs = torch.tensor([t[0] * V + t[1] for t in out.tokens])
    assert chi_square_ok(torch.bincount(pairs, minlength=V * V), torch.outer(p1, p2))
    assert 0 < len(short) < n and sum(out.num_accepted) > n // 10
    # the test tells: the pair of drafts, as drawn, is not p1 x p2
    drawn = torch.bincount(drafts[0] * V + drafts[1], minlength=V * V)
    assert not chi_square_ok(drawn, torch.outer(p1, p2))


def test_a_draft_the_target_cannot_emit_is_always_rejected() -> None:
    n = 4000
    p = SamplingParams(temperature=1.0, top_k=3)
    row = torch.randn(V, generator=gen(60))
    want = target(row, p)
    banned = int(want.argmin())  # outside the top 3
    q = torch.zeros(V)
    q[banned] = 1.0
    draft = torch.full((n,), banned)
    for probs, seed in ((None, 61), (q, 62)):  # every row rejected: no bonus row is drawn
        tokens = first_tokens(p, row, draft, probs, seed)
        assert banned not in tokens.tolist()
        assert chi_square_ok(torch.bincount(tokens, minlength=V), want)


def test_a_draft_distribution_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="draft_probs"):
        verify(
            torch.zeros(3, V),
            [[1, 2]],
            [torch.full((2, V + 1), 1.0 / (V + 1))],
            batch([SamplingParams()], [0]),
            gen(0),
        )
