"""A separate draft model (`--draft-model`) on tiny random Llamas: greedy output equal to no
speculation beside requests that do not speculate (overlap on and off, rejected drafts across
block boundaries), the target as its own draft accepting every draft, a draft of the target's
first layers drafting exactly as layer skipping does (its KV mirrors the target's), the KV pool
as a run without drafts leaves it, sampled output distributed as the target's (chi-square), the
draft cache charged to the KV budget, the profile with its passes, and the startup and settings
checks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.build.startup import StartupError
from daemon.loop.draft_model import DraftModel
from daemon.loop.engine import Engine
from daemon.loop.request import RequestStatus, SamplingParams
from daemon.loop.scheduler import ScheduledSeq
from daemon.loop.spec_profile import profile
from daemon.service.settings import ConfigError, load_settings
from tests.checkpoints import load_reference, make_dense_checkpoint, make_v4_checkpoint
from tests.spec_doubles import first_pair_counts, run_all, start_engine, tokens
from tests.test_spec_rejection import chi_square_ok

VOCAB = 512
LAYERS = 4
BLOCK = 4  # small blocks: draft positions and rejected drafts often lie in blocks of their own
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# penalties keep a request out of speculation: it runs beside the others as plain decodes
PENALISED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
PARAMS = [GREEDY, GREEDY, PENALISED, GREEDY]


def first_layers(source: Path, dest: Path, layers: int) -> Path:
    """A checkpoint of `source`'s embedding, first `layers` layers, final norm and lm_head: as a
    draft model it is what layer skipping through those layers computes."""
    dest.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dest / "config.json").write_text(json.dumps(config))
    tensors = load_file(source / "model.safetensors")
    kept = {
        name: t
        for name, t in tensors.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("llama"), "llama", layers=LAYERS)


DRAFT_LAYERS = 3  # fewer reject every draft of this random model


@pytest.fixture(scope="module")
def early(checkpoint, tmp_path_factory) -> Path:
    """The target's first layers as a draft model."""
    return first_layers(checkpoint, tmp_path_factory.mktemp("draft") / "early", DRAFT_LAYERS)


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
        spec_policy="fixed",
    )
    return await start_engine(**(settings | overrides))


def watch(engine: Engine) -> tuple[list[tuple[int, int, int]], list[tuple[bool, int, int]]]:
    """After each verify step: (blocks held before its bookkeeping, after, a request of its
    length's) of a request still running; and each verify's (penalised, drafts verified,
    accepted)."""
    seen: list[tuple[int, int, int]] = []
    outcomes: list[tuple[bool, int, int]] = []
    scheduler, kv = engine.scheduler, engine.kv
    verified = scheduler.verified

    def check(seq: ScheduledSeq, accepted: int, state_at: int | None) -> None:
        req = seq.request
        before = len(kv.tables.get(req.request_id, [[]])[0])
        outcomes.append((req.params.has_penalties, len(seq.draft), accepted))
        verified(seq, accepted, state_at)
        if req.status == RequestStatus.RUNNING:
            after = len(kv.tables[req.request_id][0])
            seen.append((before, after, -(-req.num_computed // BLOCK)))

    scheduler.verified = check
    return seen, outcomes


async def outcome(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    try:
        outs = await run_all(engine, prompts, PARAMS)
        return [tokens(o) for o in outs], engine.stats() | {"cached": set(engine.kv.cached)}
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
def reference(checkpoint, prompts) -> tuple[list[list[int]], dict]:
    """A run without speculation, and one drafting by layer skipping through the first layers."""

    async def run() -> tuple[tuple[list[list[int]], dict], dict]:
        plain = await outcome(await started(checkpoint), prompts)
        skip = await started(checkpoint, speculative="layer-skip", draft_layers=DRAFT_LAYERS)
        return plain, (await outcome(skip, prompts))[1]

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("draft", "overlap"),
    [("early", False), ("early", True), ("target", False)],
    ids=["first-layers", "first-layers-overlap", "target-itself"],
)
async def test_greedy_equals_no_speculation_beside_plain_requests(
    checkpoint, early, prompts, reference, draft, overlap
):
    path = checkpoint if draft == "target" else early
    engine = await started(checkpoint, draft_model=str(path), overlap=overlap)
    seen, outcomes = watch(engine)
    outs, stats = await outcome(engine, prompts)
    (plain, plain_stats), skip_stats = reference
    assert outs == plain
    # the KV pool as the run without drafts left it: every block free, the same ones indexed
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["cached"] == plain_stats["cached"]
    # after each verify a request holds the blocks its length needs, no more
    assert seen and all(after == need for _, after, need in seen)
    verified, accepted = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    assert verified > 0 and stats["spec_drafter"] == "draft-model"
    if draft == "target":
        # its own drafts, through its own mirrored KV (the passes draft without penalties: a
        # penalised request's may be rejected)
        plain_verifies = [(v, a) for penalised, v, a in outcomes if not penalised]
        assert plain_verifies and all(v == a for v, a in plain_verifies)
    else:
        assert 0 < accepted < verified
        # rejected drafts' blocks (and those the passes wrote past them) were given back
        assert any(before > after for before, after, _ in seen)
    if not overlap and draft == "early":
        # those layers over a KV of their own holding what the target's does: the same drafts
        assert (verified, accepted) == (
            skip_stats["spec_draft_tokens"],
            skip_stats["spec_accepted_tokens"],
        )


SAMPLE_VOCAB = 8
SAMPLED = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)


def lumped(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bins expected fewer than 5 times in `n` draws merged into one (chi-square's rule)."""
    small = probs * n < 5
    counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    return counts, torch.cat([probs[~small], probs[small].sum().reshape(1)])


async def test_sampled_tokens_are_distributed_as_the_target(tmp_path):
    """The first two output tokens of many sampled requests: the second is the draft model's
    (a different random model), taken or redrawn by rejection sampling; their joint counts fit
    the target's p(t1) p(t2 | t1), computed by transformers."""
    small = dict(vocab_size=SAMPLE_VOCAB, initializer_range=0.08)
    target = make_dense_checkpoint(tmp_path / "target", "llama", **small)
    draft = make_dense_checkpoint(tmp_path / "draft", "llama", layers=1, seed=3, **small)
    prompt = [2, 5, 3]
    n = 768
    engine = await started(target, draft_model=str(draft), max_num_seqs=128)
    try:
        outs = await run_all(engine, [prompt] * n, [SAMPLED] * n)
        stats = engine.stats()
    finally:
        await engine.stop()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    counts = first_pair_counts(outs, SAMPLE_VOCAB)
    ref = load_reference(target)
    with torch.no_grad():
        p1 = ref(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        follow = torch.tensor([prompt + [t] for t in range(SAMPLE_VOCAB)])
        p2 = ref(follow).logits[:, -1].softmax(-1)
    joint = (p1[:, None] * p2).flatten()
    assert chi_square_ok(*lumped(counts, joint, n))
    # the test can fail: the draft model's own joint does not fit
    with torch.no_grad():
        q = load_reference(draft)(follow).logits[:, -1].softmax(-1)
    assert not chi_square_ok(*lumped(counts, (p1[:, None] * q).flatten(), n))


async def test_draft_cache_is_charged_and_profiled(checkpoint, early):
    """The draft's cache has the target's blocks, and the two fit the KV budget; the profile's
    verify points make the draft passes, and every point runs the draft's forward."""
    alone = await started(checkpoint, max_num_seqs=2)
    blocks_alone = alone.kv.num_blocks
    await alone.stop()
    engine = await started(checkpoint, draft_model=str(early), max_num_seqs=2)
    runner, kv = engine.runner, engine.kv
    network = runner.drafting
    assert isinstance(network, DraftModel)
    assert network.cache.num_slots == runner.cache.num_slots == kv.num_blocks[0] * BLOCK
    # the target's layers and the draft's, in one budget
    share = LAYERS / (LAYERS + DRAFT_LAYERS)
    assert kv.num_blocks[0] == pytest.approx(blocks_alone[0] * share, abs=1)
    drafted, mirrored = [], []
    draft, mirror = runner._draft, network.mirror

    def counting(rows, verified, hidden):
        drafted.append(len(rows.slots))
        return draft(rows, verified, hidden)

    def mirroring(input_ids, positions, attention, hidden):
        mirrored.append(input_ids.shape[0])
        mirror(input_ids, positions, attention, hidden)

    runner._draft, network.mirror = counting, mirroring
    try:
        free = [u.num_free for u in kv.usage()]
        table = profile(runner, kv, 2, 64, k=3, repeats=1, point_seconds=0.05)
    finally:
        await engine.stop()
    assert [r.num_seqs for r in table.rows] == [1, 2]
    assert drafted and set(drafted) == {1, 2}
    assert 64 in mirrored and 1 in mirrored  # a prefill-sized point and a single decode
    assert [u.num_free for u in kv.usage()] == free and not kv.tables


def test_startup_refuses_what_cannot_draft(checkpoint, tmp_path):
    base = dict(model=str(checkpoint), kv_cache_memory_gb=0.01)
    with pytest.raises(StartupError, match="draft model .*missing.*config.json"):
        build_engine(EngineConfig(**base, draft_model=str(tmp_path / "missing")))
    other = make_dense_checkpoint(tmp_path / "other", "llama", vocab_size=VOCAB // 2, layers=1)
    with pytest.raises(StartupError, match="vocabulary of 256 tokens, the target's has 512"):
        build_engine(EngineConfig(**base, draft_model=str(other)))
    with pytest.raises(StartupError, match="draft_model is the draft-model drafter's"):
        build_engine(EngineConfig(**base, speculative="ngram", draft_model=str(checkpoint)))
    with pytest.raises(StartupError, match="no draft_model"):
        build_engine(EngineConfig(**base, speculative="draft-model"))
    v4 = make_v4_checkpoint(tmp_path / "v4")  # per-request state, blocks of its own geometry
    with pytest.raises(StartupError, match="dense targets only"):
        build_engine(EngineConfig(model=str(v4), kv_cache_memory_gb=0.01, draft_model=str(other)))


def test_startup_refuses_another_tokenizer(tmp_path):
    target = make_dense_checkpoint(tmp_path / "target", "llama", with_tokenizer=True)
    draft = make_dense_checkpoint(tmp_path / "draft", "llama", layers=1, with_tokenizer=True)
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same size, not the same
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(StartupError, match="its tokenizer is not the target's"):
        build_engine(
            EngineConfig(model=str(target), kv_cache_memory_gb=0.05, draft_model=str(draft))
        )


def test_settings_and_flags():
    from daemon.service.cli import build_parser
    from daemon.service.flags import settings_from

    assert load_settings().engine.draft_model is None
    e = load_settings(env={"DEEPINFER_ENGINE_DRAFT_MODEL": "/m/draft"}).engine
    assert (e.speculative, e.draft_model) == (None, "/m/draft")  # implied when built
    args = build_parser().parse_args(["serve", "--draft-model", "/m/d.gguf"])
    assert settings_from(args).engine.draft_model == "/m/d.gguf"
    both = ["serve", "--speculative", "draft-model", "--draft-model", "/m/d"]
    assert settings_from(build_parser().parse_args(both)).engine.speculative == "draft-model"
    for env in (
        {"DEEPINFER_ENGINE_DRAFT_MODEL": "/m/d", "DEEPINFER_ENGINE_SPECULATIVE": "ngram"},
        {"DEEPINFER_ENGINE_SPECULATIVE": "draft-model"},
    ):
        with pytest.raises(ConfigError) as err:
            load_settings(env=env)
        assert err.value.key == "engine.draft_model"


def test_draft_model_alone_turns_speculation_on(checkpoint, early):
    engine, _ = build_engine(
        EngineConfig(
            model=str(checkpoint),
            kv_cache_memory_gb=0.01,
            spec_policy="fixed",
            draft_model=str(early),
        )
    )
    spec = engine.scheduler.speculator
    assert spec is not None and spec.drafter.name == "draft-model"
    assert isinstance(engine.runner.drafting, DraftModel)


async def test_stale_draft_kv_costs_acceptance_not_output(checkpoint, prompts, reference):
    """The draft's KV overwritten with noise between two rounds (as blocks the prefix cache
    brings back from the host tier or the store leave it: only the target's KV is moved): the
    second round's prompts hit the device cache, the drafts over them go wrong, the output
    stays the target's."""
    n = 12
    some, params = [prompts[1], prompts[3]], [SamplingParams(max_tokens=n, temperature=0.0)] * 2
    engine = await started(checkpoint, draft_model=str(checkpoint))
    try:
        first = await run_all(engine, some, params)
        before = engine.stats()
        g = torch.Generator().manual_seed(0)
        for k, v in engine.runner.drafting.cache.layers:
            k.copy_(torch.randn(k.shape, generator=g))
            v.copy_(torch.randn(v.shape, generator=g))
        again = await run_all(engine, some, params)
        after = engine.stats()
    finally:
        await engine.stop()
    plain = [reference[0][0][i][:n] for i in (1, 3)]  # greedy: the longer run's first tokens
    assert [tokens(o) for o in first] == [tokens(o) for o in again] == plain
    assert after["prefix_hit_tokens"] > before["prefix_hit_tokens"]
    assert before["spec_accepted_tokens"] == before["spec_draft_tokens"]  # its own drafts
    verified = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert verified > 0 and accepted < verified
