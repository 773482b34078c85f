"""Draft passes on the device thread: after a step, one-token passes through a draft network
(`DraftNetwork`: the target's first layers, a separate draft model, ...), batched over the
sequences the scheduler marked, from the token each sampled; greedy rows take the argmax,
sampled rows draw from the draft distribution and keep it (for lossless rejection sampling)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from daemon.loop.constraint import Constraint, allocate_bitmask, apply_bitmask
from daemon.loop.request import SamplingParams
from daemon.loop.sampler import SamplingBatch, greedy, row_generator, warped_probs
from daemon.loop.spec.base import Draft
from daemon.loop.spec.device_drafter import EarlyDraft
from daemon.models.base import AttentionMetadata, EarlyExitModel, ModelCache, SeqSlice

# a seeded row's draft draws come from the streams of (seed, output index + this): apart from
# the target's own, which decide acceptance
DRAFT_STREAM = 1 << 40


class DraftNetwork(Protocol):
    """What the runner drafts through, on the device thread. Its `cache` is indexed by the
    target's block tables (the scheduler grows them over the draft positions), so a pass
    writes its KV at the request's own slots; the verify of the drafts rewrites the target's
    there, and a rejected draft's slots are written again before anything reads them."""

    @property
    def cache(self) -> ModelCache:
        """The KV the passes read and write (it builds their attention metadata)."""
        ...

    def mirror(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> None:
        """After the target's forward of a step (every row: prefill chunks, decodes, verify
        rows; `attention` built by the target's cache, `hidden` its output rows): whatever the
        network keeps of each known token for its later passes."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        context: torch.Tensor,
    ) -> torch.Tensor:
        """One pass of a token per sequence: rows for `logits`, writing the network's KV at
        `positions`. `context` [n, H]: per sequence, for the first pass the target's hidden row
        that sampled its token, then this network's own output of the pass before (what an MTP
        layer takes; a network that drafts from tokens alone ignores it)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 [n, V] logits of `forward`'s rows, over the target's vocabulary."""
        ...


@dataclass
class LayerSkip:
    """The target's first `num_layers` layers, its final norm and lm_head, over the target's own
    cache: the passes write those layers' KV at the draft positions, which the verify
    overwrites at every layer; the target's forward has written every known token's already."""

    model: EarlyExitModel
    target_cache: ModelCache
    num_layers: int

    @property
    def cache(self) -> ModelCache:
        return self.target_cache

    def mirror(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> None:
        """Nothing: the step's forward wrote these layers' KV in the shared cache."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        context: torch.Tensor,
    ) -> torch.Tensor:
        return self.model.forward_layers(
            input_ids, positions, attention, self.target_cache, self.num_layers
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


@dataclass
class DraftRows:
    """The sequences of a step that draft at its end (built on the host by the runner)."""

    samples: list[int] = field(default_factory=list)  # index among the step's sampling seqs
    slots: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # drafts to make
    # the position of the token the step samples, before the drafts a verify row accepts
    bases: list[int] = field(default_factory=list)
    verify: list[int | None] = field(default_factory=list)  # index among the verify seqs
    tables: list[list[list[int]]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    # the output index of the first draft, before the drafts a verify row accepts
    first_indices: list[int] = field(default_factory=list)
    # the step's logits row of its sample (a verify row's first: its accepted drafts follow)
    logits_rows: list[int] = field(default_factory=list)

    def add(
        self,
        sample: int,
        slot: int,
        count: int,
        base: int,
        verify: int | None,
        tables: list[list[int]],
        params: SamplingParams,
        first_index: int,
        logits_row: int,
    ) -> None:
        self.samples.append(sample)
        self.slots.append(slot)
        self.counts.append(count)
        self.bases.append(base)
        self.verify.append(verify)
        self.tables.append(tables)
        self.params.append(params)
        self.first_indices.append(first_index)
        self.logits_rows.append(logits_row)


@dataclass
class Drafted:
    """What the passes made: device tensors until `host` (after the step's sync)."""

    rows: DraftRows
    positions: list[int]  # of each sequence's sampled token
    tokens: torch.Tensor  # [n, 1 + k]: the sampled token, then the drafts (unused entries 0)
    confidence: torch.Tensor  # [n, k]
    probs: list[torch.Tensor | None]  # per sequence [count, V] on the device (sampled rows)

    def to_host_async(self) -> None:
        self.tokens = self.tokens.to("cpu", non_blocking=True)
        self.confidence = self.confidence.to("cpu", non_blocking=True)

    def host(self) -> list[EarlyDraft]:
        tokens, conf = self.tokens.tolist(), self.confidence.tolist()
        out = []
        for i, (n, pos) in enumerate(zip(self.rows.counts, self.positions)):
            draft = Draft(tokens[i][1 : 1 + n], conf[i][:n], self.probs[i])
            out.append(EarlyDraft(pos + 1, tokens[i][0], draft))
        return out


def draft_passes(
    network: DraftNetwork,
    rows: DraftRows,
    last_tokens: torch.Tensor,
    accepted: list[int],
    hidden: torch.Tensor,
    generator: torch.Generator,
    vocab: int,
    taken: list[list[int]] | None = None,
) -> Drafted:
    """Up to max(counts) passes of one token per sequence through `network` (fewer as counts
    run out), each writing the network's KV at its position. `last_tokens`: the runner's,
    holding what the step sampled; `accepted`: per verify sequence, the drafts it took;
    `hidden`: the target's hidden rows of the step's logits rows (the first pass's context).
    A sequence with a grammar drafts under it: each pass's logits masked by what it allows
    after the tokens its matcher has not seen, `taken[i]` (the drafts its verify accepted,
    before the token the step sampled) and the drafts before."""
    dev = last_tokens.device
    n, k = len(rows.slots), max(rows.counts)
    took = [accepted[v] if v is not None else 0 for v in rows.verify]
    positions = [b + a for b, a in zip(rows.bases, took)]
    first = [f + a for f, a in zip(rows.first_indices, took)]
    at_rows = [r + a for r, a in zip(rows.logits_rows, took)]
    # the rows the next pass takes as context, and the sequence of each
    context, context_of = (
        hidden[torch.tensor(at_rows, dtype=torch.long, device=dev)],
        list(range(n)),
    )
    tokens = torch.zeros(n, 1 + k, dtype=torch.long, device=dev)
    tokens[:, 0] = last_tokens[torch.tensor(rows.slots, dtype=torch.long, device=dev)]
    confidence = torch.zeros(n, k, dtype=torch.float32, device=dev)
    sampled = [i for i, p in enumerate(rows.params) if not p.greedy]
    probs = torch.zeros(len(sampled), k, vocab, device=dev) if sampled else None
    at = {i: r for r, i in enumerate(sampled)}  # sequence -> its row of `probs`
    grammar = _DraftGrammar.of(rows, tokens, taken or [[] for _ in range(n)], vocab)
    for j in range(k):
        act = [i for i in range(n) if rows.counts[i] > j]
        index = torch.tensor(act, dtype=torch.long, device=dev)
        slices = [SeqSlice(r, positions[i] + j, 1, rows.tables[i], True) for r, i in enumerate(act)]
        pos = torch.tensor([positions[i] + j for i in act], dtype=torch.long)
        attention = network.cache.build_attention(slices).to(dev)
        row_of = {i: r for r, i in enumerate(context_of)}
        ctx = context[torch.tensor([row_of[i] for i in act], dtype=torch.long, device=dev)]
        out = network.forward(tokens[index, j], pos.to(dev, non_blocking=True), attention, ctx)
        logits = network.logits(out)
        if grammar is not None:
            grammar.mask(logits, act)
        context, context_of = out, act
        params = [rows.params[i] for i in act]
        sb = SamplingBatch.build(params, [first[i] + j for i in act], vocab).to(dev)
        chosen = greedy(logits)
        if sb.all_greedy:  # the confidence: the argmax's softmax probability
            q = logits.softmax(dim=-1)
        else:  # a greedy row's is its softmax too
            q = warped_probs(logits, sb)
            drawn = _draw(q, params, sb.sample_indices, generator)
            chosen = torch.where(sb.greedy.to(dev), chosen, drawn)
            rows_q = [r for r, i in enumerate(act) if i in at]
            targets = torch.tensor([at[act[r]] for r in rows_q], dtype=torch.long, device=dev)
            probs[targets, j] = q[torch.tensor(rows_q, dtype=torch.long, device=dev)]
        tokens[index, j + 1] = chosen
        confidence[index, j] = q.gather(1, chosen[:, None]).squeeze(1)
        if grammar is not None:
            grammar.took(act, chosen)
    per_seq: list[torch.Tensor | None] = [
        probs[at[i], : rows.counts[i]] if i in at and probs is not None else None for i in range(n)
    ]
    return Drafted(rows, positions, tokens, confidence, per_seq)


@dataclass
class _DraftGrammar:
    """The constrained sequences' tokens on the host as their passes go (what their matchers
    have not seen), to mask each pass's logits rows."""

    constraints: dict[int, Constraint]  # sequence -> its grammar
    seen: dict[int, list[int]]  # sequence -> the tokens after those its matcher has seen
    vocab: int

    @staticmethod
    def of(
        rows: DraftRows, tokens: torch.Tensor, taken: list[list[int]], vocab: int
    ) -> _DraftGrammar | None:
        constraints = {
            i: p.constraint for i, p in enumerate(rows.params) if p.constraint is not None
        }
        if not constraints:
            return None
        at = list(constraints)
        index = torch.tensor(at, dtype=torch.long, device=tokens.device)
        last = tokens[index, 0].tolist()  # the token the step sampled
        seen = {i: [*taken[i], t] for i, t in zip(at, last)}
        return _DraftGrammar(constraints, seen, vocab)

    def mask(self, logits: torch.Tensor, act: list[int]) -> None:
        """Mask the rows of `act` (the pass's sequences, in its rows' order) in place."""
        bitmask, masked = None, []
        for r, i in enumerate(act):
            constraint = self.constraints.get(i)
            if constraint is None:
                continue
            bitmask = bitmask if bitmask is not None else allocate_bitmask(len(act), self.vocab)
            if constraint.fill_after(bitmask, r, self.seen[i]):
                masked.append(r)
        if bitmask is not None and masked:
            apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), masked)

    def took(self, act: list[int], chosen: torch.Tensor) -> None:
        rows = [r for r, i in enumerate(act) if i in self.constraints]
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=chosen.device)
            for r, t in zip(rows, chosen[index].tolist()):
                self.seen[act[r]].append(t)


def _draw(
    q: torch.Tensor,
    params: list[SamplingParams],
    indices: list[int],
    generator: torch.Generator,
) -> torch.Tensor:
    """A token per row from `q` by the inverse CDF; a seeded row's uniform from its draft
    stream, so that its drafts do not depend on the batch."""
    dev = q.device
    u = torch.rand(q.shape[0], generator=generator, device=dev)
    for row, (p, idx) in enumerate(zip(params, indices)):
        if p.seed is not None and not p.greedy:
            g = row_generator(p.seed, idx + DRAFT_STREAM, dev)
            u[row] = torch.rand(1, generator=g, device=dev)[0]
    cum = q.double().cumsum(-1)
    picked = torch.searchsorted(cum, (u.double() * cum[:, -1])[:, None], right=True).squeeze(1)
    # past the last token of positive mass only by rounding: take that one
    last = q.shape[-1] - 1 - (q > 0).flip(-1).int().argmax(-1)
    return torch.minimum(picked, last)
