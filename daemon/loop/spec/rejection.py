"""Verification of drafts against the target's logits: greedy rows accept while the argmax agrees,
sampled rows by rejection sampling, so that output is distributed as without drafts."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from daemon.loop.request import SamplingParams
from daemon.loop.sampler import SamplingBatch, row_generator, sample, warped_probs


@dataclass
class VerifyResult:
    """Per sequence: its accepted drafts, then the one token the target chose after them."""

    tokens: list[list[int]]
    num_accepted: list[int]
    rows: list[list[int]]  # per emitted token: the logits row it was decided at


def verify(
    logits: torch.Tensor,
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    sampling: SamplingBatch,
    generator: torch.Generator | None,
) -> VerifyResult:
    """logits: [R, V] float32 after penalties, bias and grammar masks; sequence i owns
    len(drafts[i]) + 1 consecutive rows, the last its bonus row. draft_probs[i]: the
    [len(drafts[i]), V] distributions its drafts were drawn from, or None for point masses.
    sampling: one row per sequence, its sample index that of the sequence's first row; row j
    of a sequence produces output token sample_index + j, and a seeded sequence draws it from
    that index's stream, so its tokens do not depend on the batch.

    A draft d at a row with target p and draft q is accepted with probability
    min(1, p(d) / q(d)), else the row emits a draw from norm(max(p - q, 0)) and the sequence
    stops there (Leviathan et al. 2023). For a point mass that is the same as drawing from p
    and accepting if the draw is d (the residual is p without d), so those rows, greedy rows
    and bonus rows are all drawn by sample() itself: a seeded request's tokens with point-mass
    drafts are the ones it gets without drafts, and a sequence with no draft is sample()."""
    counts = [len(d) + 1 for d in drafts]
    if len(drafts) != len(sampling.params) or len(draft_probs) != len(drafts):
        raise ValueError("one draft, draft_probs entry and sampling row per sequence")
    if sum(counts) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for drafts of lengths {counts}")
    starts = [0, *accumulate(counts)][:-1]
    num_rows, vocab, device = logits.shape[0], logits.shape[1], logits.device
    # rows decided against a draft distribution; the others are drawn by sample()
    q_seqs = [
        i
        for i, (d, q, p) in enumerate(zip(drafts, draft_probs, sampling.params))
        if d and q is not None and not p.greedy
    ]
    q_rows = [starts[i] + j for i in q_seqs for j in range(len(drafts[i]))]
    q_set = set(q_seqs)
    emit = [0] * num_rows  # the token a row emits when its sequence stops there
    accepted = [False] * num_rows  # whether a draft row accepts its draft
    if q_rows:
        q_emit, q_accept = _reject(logits, q_seqs, starts, drafts, draft_probs, sampling, generator)
        for r, t, a in zip(q_rows, q_emit, q_accept):
            emit[r], accepted[r] = t, a
    if num_rows == len(drafts):  # nothing drafted: sample() over the batch as it is
        s_rows = list(range(num_rows))
        s_tokens = sample(logits, sampling, generator).tokens.tolist()
    else:
        decided = set(q_rows)
        s_rows, s_params, s_indices = [], [], []
        for i, (start, n) in enumerate(zip(starts, counts)):
            for j in range(n):
                if start + j not in decided:
                    s_rows.append(start + j)
                    s_params.append(sampling.params[i])
                    s_indices.append(sampling.sample_indices[i] + j)
        sb = SamplingBatch.build(s_params, s_indices, vocab).to(device)
        index = torch.tensor(s_rows, dtype=torch.long, device=device)
        s_tokens = sample(logits[index], sb, generator).tokens.tolist()
    for r, t in zip(s_rows, s_tokens):
        emit[r] = t
    tokens: list[list[int]] = []
    for i, (draft, start) in enumerate(zip(drafts, starts)):
        out = []
        for j, d in enumerate(draft):
            r = start + j
            if not (accepted[r] if i in q_set else emit[r] == d):
                out.append(emit[r])
                break
            out.append(d)
        else:
            out.append(emit[start + len(draft)])
        tokens.append(out)
    return VerifyResult(
        tokens,
        [len(t) - 1 for t in tokens],
        [list(range(start, start + len(t))) for start, t in zip(starts, tokens)],
    )


def _reject(
    logits: torch.Tensor,
    seqs: list[int],
    starts: list[int],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    sampling: SamplingBatch,
    generator: torch.Generator | None,
) -> tuple[list[int], list[bool]]:
    """The draft rows of `seqs` (sampled, with draft distributions), in order: per row the
    residual draw it emits on a rejection, and whether it accepts its draft."""
    device, vocab = logits.device, logits.shape[1]
    rows = [starts[i] + j for i in seqs for j in range(len(drafts[i]))]
    params = [sampling.params[i] for i in seqs for _ in drafts[i]]
    indices = [sampling.sample_indices[i] + j for i in seqs for j in range(len(drafts[i]))]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    p = warped_probs(logits[index], SamplingBatch.build(params, indices, vocab).to(device))
    q = torch.cat([_draft_dist(draft_probs[i], len(drafts[i]), vocab) for i in seqs])
    q = q.to(device=device, dtype=p.dtype)
    d = torch.tensor([t for i in seqs for t in drafts[i]], dtype=torch.long, device=device)
    pd, qd = p.gather(1, d[:, None]).squeeze(1), q.gather(1, d[:, None]).squeeze(1)
    u = _uniforms(params, indices, generator, device)
    accept = u[:, 0] * qd < pd  # u < p(d) / q(d) without dividing by a q(d) of 0
    residual = (p - q).clamp_min_(0.0)
    # p == q up to rounding: a rejection is (nearly) impossible, and p is its limit
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return _inverse_cdf(residual, u[:, 1]).tolist(), accept.tolist()


def _draft_dist(q: torch.Tensor | None, n: int, vocab: int) -> torch.Tensor:
    assert q is not None
    if q.shape != (n, vocab):
        raise ValueError(f"draft_probs of shape {tuple(q.shape)} for {n} drafts over {vocab}")
    return q


def _uniforms(
    params: list[SamplingParams],
    indices: list[int],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """[N, 2] per row: the acceptance draw and the residual's; a seeded row's from the stream of
    its (seed, output index)."""
    u = torch.rand(len(params), 2, generator=generator, device=device)
    for row, (p, idx) in enumerate(zip(params, indices)):
        if p.seed is not None:
            u[row] = torch.rand(2, generator=row_generator(p.seed, idx, device), device=device)
    return u


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, V] non-negative weights, u [N] in [0, 1) -> [N]: the first token, in id order, at
    which the cumulative weight passes u * the total."""
    cum = weights.double().cumsum(-1)
    pos = (cum <= u.double()[:, None] * cum[:, -1:]).sum(-1)
    # past the last token of positive weight only by rounding: take that one
    last = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(-1)
    return torch.minimum(pos, last)
