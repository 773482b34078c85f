"""Layer-skip drafting (`--speculative layer-skip`) on a tiny random Llama: greedy output equal to
no speculation beside requests that do not speculate (overlap on and off, drafts rejected across
block boundaries), the KV pool as a run without drafts leaves it, seeded sampled output
reproducible with the draft distributions verified, the drafter's bookkeeping, the profile with
drafting, and the settings and startup checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.build.startup import StartupError
from daemon.loop.engine import Engine
from daemon.loop.request import Request, RequestStatus, SamplingParams
from daemon.loop.scheduler import ScheduledSeq
from daemon.loop.spec.base import Draft
from daemon.loop.spec.device_drafter import DeviceDrafter, EarlyDraft
from daemon.loop.spec_profile import profile
from daemon.service.settings import ConfigError, load_settings
from tests.checkpoints import make_dense_checkpoint, make_v4_checkpoint
from tests.spec_doubles import run_all, start_engine, tokens

VOCAB = 512
LAYERS = 4
BLOCK = 4  # small blocks: draft positions and rejected drafts often lie in blocks of their own
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# penalties keep a request out of speculation: it runs beside the others as plain decodes
PENALISED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
SEEDED = SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    return make_dense_checkpoint(path, "llama", vocab_size=VOCAB, layers=LAYERS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]


async def started(checkpoint: Path, **overrides) -> Engine:
    settings = dict(
        model=str(checkpoint),
        kv_cache_memory_gb=0.01,
        max_num_batched_tokens=64,
        block_size=BLOCK,
        overlap=False,
        speculative="layer-skip",
        spec_policy="fixed",
    )
    return await start_engine(**(settings | overrides))


def watch(engine: Engine) -> tuple[list[tuple[int, int, int]], list[tuple[Request, int]]]:
    """After each verify step: (blocks held before its bookkeeping, after, a request of its
    length's) of a request still running; and each sequence marked to draft (with its count)."""
    seen: list[tuple[int, int, int]] = []
    marked: list[tuple[Request, int]] = []
    scheduler, kv, runner = engine.scheduler, engine.kv, engine.runner
    verified, prepare = scheduler.verified, runner.prepare

    def check(seq: ScheduledSeq, accepted: int, state_at: int | None) -> None:
        req = seq.request
        before = len(kv.tables.get(req.request_id, [[]])[0])
        verified(seq, accepted, state_at)
        if req.status == RequestStatus.RUNNING:
            after = len(kv.tables[req.request_id][0])
            seen.append((before, after, -(-req.num_computed // BLOCK)))

    def prepared(step, kv_, ops):
        marked.extend((s.request, s.draft_after) for s in step.seqs if s.draft_after)
        return prepare(step, kv_, ops)

    scheduler.verified = check
    runner.prepare = prepared
    return seen, marked


PARAMS = [GREEDY, GREEDY, PENALISED, GREEDY]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts) -> tuple[list[list[int]], set[bytes]]:
    """A run without speculation: its outputs and the blocks it left indexed."""

    async def run() -> tuple[list[list[int]], set[bytes]]:
        engine = await started(checkpoint, speculative=None)
        try:
            outs = await run_all(engine, prompts, PARAMS)
            return [tokens(o) for o in outs], set(engine.kv.cached)
        finally:
            await engine.stop()

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("draft_layers", "overlap"),
    [(LAYERS, False), (1, False), (1, True)],
    ids=["all-layers", "one-layer", "one-layer-overlap"],
)
async def test_greedy_equals_no_speculation_beside_plain_requests(
    checkpoint, prompts, reference, draft_layers, overlap
):
    engine = await started(checkpoint, draft_layers=draft_layers, overlap=overlap)
    seen, marked = watch(engine)
    try:
        drafted = await run_all(engine, prompts, PARAMS)
        stats = engine.stats()
    finally:
        await engine.stop()
    plain, plain_cached = reference
    assert [tokens(o) for o in drafted] == plain
    assert marked and all(not r.params.has_penalties for r, _ in marked)  # never drafted for
    assert all(1 <= n <= 5 for _, n in marked)
    # the KV pool as the run without drafts left it: every block free, the same ones indexed
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert set(engine.kv.cached) == plain_cached
    # after each verify a request holds the blocks its length needs, no more
    assert seen and all(after == need for _, after, need in seen)
    verified, accepted = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    assert verified > 0 and stats["spec_drafter"] == "layer-skip"
    if draft_layers == LAYERS:
        # drafts through every layer are the target's own tokens
        assert accepted == verified
        assert any(len(o.new_token_ids) == 6 for outs in drafted for o in outs)  # k + 1 at once
    else:
        assert accepted < verified
        # rejected drafts' blocks (and those the passes wrote past them) were given back
        assert any(before > after for before, after, _ in seen)


async def test_seeded_sampling_reproducible_with_draft_distributions(checkpoint, prompts):
    """A seeded sampled request gets the same tokens in another run, beside other requests or
    alone; its drafts carry their distributions, which drafts through every layer match."""
    engine = await started(checkpoint, draft_layers=LAYERS)
    drafter = engine.scheduler.speculator.drafter
    proposals: list[tuple[Request, Draft]] = []
    propose = drafter.propose

    def recording(req: Request, k: int) -> Draft:
        draft = propose(req, k)
        if draft.tokens:
            proposals.append((req, draft))
        return draft

    drafter.propose = recording
    other = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, ignore_eos=True)
    try:
        first = await run_all(engine, prompts[:3], [SEEDED, GREEDY, other])
        again = await run_all(engine, [prompts[0]], [SEEDED])
        stats = engine.stats()
    finally:
        await engine.stop()
    assert tokens(first[0]) == tokens(again[0])
    assert len(tokens(first[0])) == 20
    sampled = [(r, d) for r, d in proposals if not r.params.greedy]
    greedy = [d for r, d in proposals if r.params.greedy]
    assert sampled and greedy
    assert all(d.probs is None for d in greedy)
    for _, d in sampled:
        assert d.probs is not None and d.probs.shape == (len(d.tokens), VOCAB)
        assert torch.allclose(d.probs.sum(-1), torch.ones(len(d.tokens)), atol=1e-4)
        # each token drawn from its own distribution, its confidence that probability
        picked = d.probs[torch.arange(len(d.tokens)), torch.tensor(d.tokens)]
        assert (picked > 0).all()
        assert picked.tolist() == pytest.approx(d.confidence, abs=1e-6)
    # the draft distribution equals the target's here: rejection sampling takes nearly all
    assert stats["spec_accepted_tokens"] >= 0.95 * stats["spec_draft_tokens"] > 0


def test_drafter_hands_over_only_drafts_that_follow_the_known_tokens():
    drafter = DeviceDrafter("layer-skip")
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=8))
    req.output_ids = [9]
    draft = Draft([1, 2, 3], [0.9, 0.5, 0.2])
    drafter.receive(req, EarlyDraft(4, 9, draft))
    got = drafter.propose(req, 2)
    assert (got.tokens, got.confidence) == ([1, 2], [0.9, 0.5])
    assert drafter.propose(req, 2).tokens == []  # handed over once
    drafter.receive(req, EarlyDraft(4, 8, draft))  # another last token: not these tokens
    assert drafter.propose(req, 3).tokens == []
    drafter.receive(req, EarlyDraft(3, 7, draft))  # one token behind
    assert drafter.propose(req, 3).tokens == []
    drafter.receive(req, EarlyDraft(4, 9, draft))
    drafter.finished(req)
    assert drafter.propose(req, 3).tokens == []


async def test_profile_times_verify_points_with_their_drafting(checkpoint):
    engine = await started(checkpoint, draft_layers=2, max_num_seqs=2)
    runner, kv = engine.runner, engine.kv
    drafted: list[int] = []
    draft = runner._draft

    def counting(rows, verified, hidden):
        drafted.append(len(rows.slots))
        return draft(rows, verified, hidden)

    runner._draft = counting
    try:
        free = [u.num_free for u in kv.usage()]
        table = profile(runner, kv, 2, 64, k=3, repeats=1, point_seconds=0.05)
    finally:
        await engine.stop()
    assert [r.num_seqs for r in table.rows] == [1, 2]
    # every verify point's sequences drafted (each timed run and its untimed first)
    assert drafted and set(drafted) == {1, 2}
    assert [u.num_free for u in kv.usage()] == free and not kv.tables


def test_startup_refuses_what_cannot_draft(checkpoint, tmp_path):
    with pytest.raises(StartupError, match="draft_layers 5"):
        build_engine(EngineConfig(model=str(checkpoint), speculative="layer-skip", draft_layers=5))
    v4 = make_v4_checkpoint(tmp_path / "v4")  # per-request state: no partial forwards
    with pytest.raises(StartupError, match="cannot draft from its own first layers"):
        build_engine(EngineConfig(model=str(v4), kv_cache_memory_gb=0.01, speculative="layer-skip"))


def test_settings_and_flags():
    from daemon.service.cli import build_parser
    from daemon.service.flags import settings_from

    assert load_settings().engine.draft_layers == 0
    env = {"DEEPINFER_ENGINE_SPECULATIVE": "layer-skip", "DEEPINFER_ENGINE_DRAFT_LAYERS": "12"}
    e = load_settings(env=env).engine
    assert (e.speculative, e.draft_layers) == ("layer-skip", 12)
    args = build_parser().parse_args(
        ["serve", "--speculative", "layer-skip", "--draft-layers", "9"]
    )
    assert settings_from(args).engine.draft_layers == 9
    with pytest.raises(ConfigError) as err:
        load_settings(env={"DEEPINFER_ENGINE_DRAFT_LAYERS": "-1"})
    assert err.value.key == "engine.draft_layers"
