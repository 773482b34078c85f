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
    # sequences decided against a draft distribution; sample() draws every other row
    q_seqs = [
        i
        for i, (d, q, p) in enumerate(zip(drafts, draft_probs, sampling.params))
        if d and q is not None and not p.greedy
    ]
    q_out = _reject(logits, q_seqs, starts, drafts, draft_probs, sampling, generator)
    decided = dict(zip(q_seqs, q_out))
    emit = [0] * num_rows  # the token sample() drew at a row
    if num_rows == len(drafts):  # nothing drafted: sample() over the batch as it is
        emit = sample(logits, sampling, generator).tokens.tolist()
    else:
        s_rows, s_params, s_indices = [], [], []
        for i, (start, n) in enumerate(zip(starts, counts)):
            # a sequence decided by rejection needs its bonus row only if it took every draft
            first = 0 if i not in decided else n - 1 if decided[i][1] is None else n
            for j in range(first, n):
                s_rows.append(start + j)
                s_params.append(sampling.params[i])
                s_indices.append(sampling.sample_indices[i] + j)
        if s_rows:
            sb = SamplingBatch.build(s_params, s_indices, vocab).to(device)
            s_logits = logits
            if len(s_rows) < num_rows:
                s_logits = logits[torch.tensor(s_rows, dtype=torch.long, device=device)]
            for r, t in zip(s_rows, sample(s_logits, sb, generator).tokens.tolist()):
                emit[r] = t
    tokens: list[list[int]] = []
    for i, (draft, start) in enumerate(zip(drafts, starts)):
        if i in decided:
            n, residual = decided[i]
            tokens.append(draft + [emit[start + n]] if residual is None else draft[:n] + [residual])
            continue
        out = []
        for j, d in enumerate(draft):
            out.append(emit[start + j])
            if emit[start + j] != d:
                break
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
) -> list[tuple[int, int | None]]:
    """Rejection sampling of the drafts of `seqs` (sampled, with draft distributions): per
    sequence, how many drafts it accepts and, if it rejects one, the residual draw there."""
    if not seqs:
        return []
    device, vocab = logits.device, logits.shape[1]
    qs = [_draft_dist(draft_probs[i], len(drafts[i]), vocab) for i in seqs]
    rows = [starts[i] + j for i in seqs for j in range(len(drafts[i]))]
    params = [sampling.params[i] for i in seqs for _ in drafts[i]]
    indices = [sampling.sample_indices[i] + j for i in seqs for j in range(len(drafts[i]))]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    p = warped_probs(logits[index], SamplingBatch.build(params, indices, vocab).to(device))
    d = torch.tensor([t for i in seqs for t in drafts[i]], dtype=torch.long, device=device)
    pd = p.gather(1, d[:, None]).squeeze(1)
    qd = torch.cat(
        [q.gather(1, torch.tensor(drafts[i], device=q.device)[:, None]) for i, q in zip(seqs, qs)]
    )
    qd = qd.squeeze(1).to(device=device, dtype=p.dtype)
    u = _uniforms(params, indices, generator, device)
    accept = (u[:, 0] * qd < pd).tolist()  # u < p(d) / q(d) without dividing by a q(d) of 0
    out: list[tuple[int, int | None]] = []
    rejected: list[int] = []  # the first rejected row of each sequence that rejects one
    q_rejected: list[torch.Tensor] = []
    offset = 0
    for i, q in zip(seqs, qs):
        n = len(drafts[i])
        taken = accept[offset : offset + n]
        num = taken.index(False) if False in taken else n
        out.append((num, None))
        if num < n:
            rejected.append(offset + num)
            q_rejected.append(q[num])
        offset += n
    if rejected:
        at = torch.tensor(rejected, dtype=torch.long, device=device)
        p_at = p[at]
        residual = (p_at - torch.stack(q_rejected).to(device=device, dtype=p.dtype)).clamp_min_(0)
        # p == q up to rounding: a rejection is (nearly) impossible, and p is its limit
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
        drawn = iter(_inverse_cdf(residual, u[at, 1]).tolist())
        out = [
            (num, None if num == len(drafts[i]) else next(drawn)) for (num, _), i in zip(out, seqs)
        ]
    return out


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
