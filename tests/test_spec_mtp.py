"""DeepSeek-V4's MTP layer as a drafter, on a tiny random V4 (window 8, compression every 4 and 8
tokens) whose checkpoint has `mtp.0.*` tensors under DeepSeek's names: the layer built from
them, its cached (chunked, token by token, batched) forward equal to a full recompute, its
state through rejected drafts; and `--speculative mtp` in the engine: greedy output equal to
no speculation beside a request that does not speculate, the V4 state after each rollback
that of a run that never drafted, overlap after a prefix hit, and the startup errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from daemon.build.startup import StartupError
from daemon.loop.request import SamplingParams
from daemon.models.base import SeqSlice
from daemon.models.checkpoints import add_v4_mtp_tensors
from daemon.models.deepseek_v4.batch import V4Batch, V4SeqMeta
from daemon.models.deepseek_v4.mtp import MTPCache, MTPDraftNetwork, MTPLayer, build_mtp
from daemon.models.loader import load_model
from tests.checkpoints import load_reference, make_dense_checkpoint, make_v4_checkpoint
from tests.spec_doubles import first_pair_counts, run_all
from tests.test_spec_draftmodel import lumped
from tests.test_spec_rejection import chi_square_ok
from tests.test_spec_v4 import collect, record_rollbacks, record_states, started

VOCAB = 512
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PENALISED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=0.5)
# the tensors that write into the residual streams (attention and expert outputs)
WRITERS = ("wo_b.weight", "w2.weight")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return add_v4_mtp_tensors(make_v4_checkpoint(tmp_path_factory.mktemp("v4-mtp")))


@pytest.fixture(scope="module")
def drafting(tmp_path_factory) -> Path:
    """A V4 whose layers write little into the residual streams (x0.01), so that its next
    token is mostly a function of the current one, and an MTP layer that mostly predicts from
    its token's embedding the same way (identity e_proj, the target's final norm, a small
    h_proj): its drafts are accepted often and rejected often."""
    path = add_v4_mtp_tensors(make_v4_checkpoint(tmp_path_factory.mktemp("v4-mtp-drafting")))
    model = load_file(str(path / "model.safetensors"))
    mtp = load_file(str(path / "mtp.safetensors"))
    for tensors in (model, mtp):
        for name in tensors:
            if name.endswith(WRITERS):
                tensors[name] = tensors[name] * 0.01
    d = mtp["mtp.0.e_proj.weight"].shape[0]
    mtp["mtp.0.e_proj.weight"] = torch.eye(d)
    mtp["mtp.0.h_proj.weight"] = mtp["mtp.0.h_proj.weight"] * 0.01
    mtp["mtp.0.enorm.weight"] = torch.ones(d)
    mtp["mtp.0.norm.weight"] = model["model.norm.weight"].clone()
    save_file(model, str(path / "model.safetensors"))
    save_file(mtp, str(path / "mtp.safetensors"))
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 14, 30)]


@pytest.fixture(scope="module")
def target(checkpoint):
    return load_model(checkpoint, torch.device("cpu"), torch.float32).model


@pytest.fixture(scope="module")
def mtp(target) -> MTPLayer:
    return build_mtp(target)


def run(mtp: MTPLayer, cache: MTPCache, parts, streams, ids) -> torch.Tensor:
    """One forward over `parts` [(request, start, count)]: request r's positions
    start..start+count, from streams[r] at the position before each and ids[r] at it, its
    ring the r-th block."""
    slices, rows, q = [], [], 0
    for r, start, count in parts:
        slices.append(SeqSlice(q, start, count, [[r]], count == 1))
        rows.append((r, start, count))
        q += count
    batch = cache.build_attention(slices)
    x = torch.cat([streams[r][s - 1 : s - 1 + n] for r, s, n in rows])
    next_ids = torch.cat([ids[r][s : s + n] for r, s, n in rows])
    positions = torch.cat([torch.arange(s, s + n) for _, s, n in rows])
    with torch.inference_mode():
        return mtp(x, next_ids, positions, batch, cache)


def inputs(n: int, seed: int, hc: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, hc, d, generator=g), torch.randint(2, VOCAB, (n,), generator=g)


def test_the_loader_keeps_what_build_mtp_needs(target, mtp):
    cfg = target.cfg
    assert cfg.num_mtp_layers == 1 and cfg.mtp_layer_type == "sliding_attention"
    assert mtp.block.self_attn.compressor is None and not mtp.block.mlp.gate.hashed
    kept = {k.replace("__", "."): v for k, v in target.mtp.items()}
    assert torch.equal(mtp.e_proj.weight, kept["mtp.0.e_proj.weight"])
    assert torch.equal(mtp.block.self_attn.q_a_proj.weight, kept["mtp.0.attn.wq_a.weight"])
    assert torch.equal(
        mtp.block.mlp.gate_up_proj[3, : cfg.moe_intermediate_size],
        kept["mtp.0.ffn.experts.3.w1.weight"],
    )
    # embedding and head are the target's, not copies
    assert mtp._shared[0] is target.embed_tokens and mtp._shared[1] is target.lm_head
    assert not any(p is target.lm_head.weight for p in mtp.parameters())
    streams, ids = inputs(6, 0, cfg.hc_mult, cfg.hidden_size)
    cache = MTPCache.allocate(cfg, mtp.layer, 2, torch.device("cpu"), torch.float32)
    logits = mtp.compute_logits(run(mtp, cache, [(0, 1, 5)], [streams], [ids]))
    assert logits.shape == (5, VOCAB) and torch.isfinite(logits).all()


def test_incremental_equals_full_recompute(target, mtp):
    """Two requests: one chunk of all their rows vs a chunk, then batched one-token passes,
    past several ring wraps (ring 15 rows, 40 positions)."""
    cfg, n = target.cfg, 40
    data = [inputs(n, seed, cfg.hc_mult, cfg.hidden_size) for seed in (1, 2)]
    streams, ids = [d[0] for d in data], [d[1] for d in data]
    dev, dtype = torch.device("cpu"), torch.float32
    full = [
        run(mtp, MTPCache.allocate(cfg, mtp.layer, 2, dev, dtype), [(r, 1, n - 1)], streams, ids)
        for r in (0, 1)
    ]
    cache = MTPCache.allocate(cfg, mtp.layer, 2, dev, dtype)
    first = run(mtp, cache, [(0, 1, 12), (1, 1, 4)], streams, ids)
    got = [[first[:12]], [first[12:]]]
    pos = [13, 5]
    while min(pos) < n:
        parts = [(r, pos[r], 1) for r in (0, 1) if pos[r] < n]
        if pos[1] == 20:  # a chunk among the decodes
            parts[1] = (1, 20, 7)
        out = run(mtp, cache, parts, streams, ids)
        q = 0
        for r, _, count in parts:
            got[r].append(out[q : q + count])
            pos[r] += count
            q += count
    for r in (0, 1):
        # fp32 sums in another order (a chunk vs one-token passes): on an AMD EPYC one element
        # of 4992 differed by 1.08e-5; a pass over a wiped ring differs by over 1e-3 (below)
        torch.testing.assert_close(torch.cat(got[r]), full[r], atol=1e-4, rtol=1e-4)
    # the passes did read the ring: the last one over a wiped ring differs
    wiped = MTPCache.allocate(cfg, mtp.layer, 2, dev, dtype)
    alone = run(mtp, wiped, [(0, n - 1, 1)], streams, ids)
    assert (alone - full[0][-1:]).abs().max() > 1e-3
    # and the head: logits of every position, both ways
    torch.testing.assert_close(
        mtp.compute_logits(torch.cat(got[0])), mtp.compute_logits(full[0]), atol=1e-4, rtol=1e-4
    )


def test_mirror_and_passes_keep_the_accepted_tokens_entries(target, mtp):
    """The draft network's state after the steps of two requests (a prefill, draft passes,
    a verify whose last drafts are rejected, then: a decode after the accepted ones (dense
    style), or a recompute from the verify's start (V4 style), then decodes): a pass at the
    end equals a full recompute over the accepted tokens."""
    cfg, n, k = target.cfg, 18, 5  # the last pass reads positions 10..17
    dev, dtype = torch.device("cpu"), torch.float32
    net = MTPDraftNetwork(mtp, MTPCache.allocate(cfg, mtp.layer, 2, dev, dtype, k + 2))
    data = [inputs(n, seed, cfg.hc_mult, cfg.hidden_size) for seed in (3, 4)]
    streams, ids = [d[0] for d in data], [d[1] for d in data]
    junk_streams, junk_ids = inputs(n + 8, 9, cfg.hc_mult, cfg.hidden_size)
    full = [
        run(mtp, MTPCache.allocate(cfg, mtp.layer, 2, dev, dtype), [(r, 1, n - 1)], streams, ids)
        for r in (0, 1)
    ]

    def mirror(parts, rejected_from: int = n) -> None:
        """A target step over `parts` [(request, start, count)]; positions from
        `rejected_from` on hold rejected drafts (their tokens and outputs are junk)."""
        metas, rows, tokens, positions = [], [], [], []
        for r, start, count in parts:
            metas.append(V4SeqMeta(len(rows), start, count, r, -1, [], []))
            for p in range(start, start + count):
                bad = p >= rejected_from
                rows.append(junk_streams[p] if bad else streams[r][p])
                tokens.append(int(junk_ids[p] if bad else ids[r][p]))
                positions.append(p)
        with torch.inference_mode():
            net.mirror(
                torch.tensor(tokens),
                torch.tensor(positions),
                V4Batch(seqs=metas),
                torch.stack(rows),
            )

    def draft_pass(parts, real: bool) -> torch.Tensor:
        """A pass per (request, position): from the target's streams before it and its token
        (`real`), or from junk (a chained pass's draft)."""
        slices = [SeqSlice(i, p, 1, [[r]], True) for i, (r, p) in enumerate(parts)]
        context = torch.stack([(streams[r] if real else junk_streams)[p - 1] for r, p in parts])
        tokens = torch.tensor([int((ids[r] if real else junk_ids)[p]) for r, p in parts])
        positions = torch.tensor([p for _, p in parts])
        with torch.inference_mode():
            return net.forward(tokens, positions, net.cache.build_attention(slices), context)

    mirror([(0, 0, 10), (1, 0, 10)])
    draft_pass([(0, 10), (1, 10)], real=True)
    draft_pass([(0, 11), (1, 11)], real=False)
    draft_pass([(0, 12), (1, 12)], real=False)
    mirror([(0, 10, 6), (1, 10, 6)], rejected_from=13)  # drafts 11, 12 taken, 13.. not
    draft_pass([(0, 13)], real=True)
    draft_pass([(0, 14), (1, 14)], real=False)
    mirror([(0, 13, 1), (1, 10, 4)])
    for p in range(14, n - 1):
        mirror([(0, p, 1), (1, p, 1)])
    last = draft_pass([(0, n - 1), (1, n - 1)], real=True)
    for r in (0, 1):
        torch.testing.assert_close(last[r], full[r][-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        net.logits(last), mtp.compute_logits(torch.stack([f[-1] for f in full]))
    )


def test_build_mtp_refuses_a_checkpoint_without_its_tensors(tmp_path):
    path = make_v4_checkpoint(tmp_path / "plain")
    target = load_model(path, torch.device("cpu"), torch.float32).model
    with pytest.raises(ValueError, match=r"no mtp\.0\.\* tensors"):
        build_mtp(target)


# ---- the engine: --speculative mtp ---------------------------------------------------------


PARAMS = [GREEDY, PENALISED, GREEDY]


@pytest.fixture(scope="module")
def plain_run(drafting, prompts) -> tuple[list[list[int]], dict]:
    """The prompts without speculation (the second with penalties), and each request's V4
    state after each step."""

    async def run() -> tuple[list[list[int]], dict]:
        engine = await started(drafting)
        try:
            states = record_states(engine)
            outs = await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, PARAMS)))
        finally:
            await engine.stop()
        return list(outs), states

    return asyncio.run(run())


async def test_greedy_equal_and_rollback_leaves_no_trace(drafting, prompts, plain_run):
    """A fresh engine (the same blocks, in the same order as the plain run's) drafting with
    the MTP layer, every draft verified (fixed policy)."""
    plain, plain_states = plain_run
    engine = await started(
        drafting, speculative="mtp", spec_policy="fixed", num_speculative_tokens=4
    )
    rolled = record_rollbacks(engine)
    try:
        spec_states = record_states(engine)
        drafted = await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, PARAMS)))
        stats = engine.stats()
    finally:
        await engine.stop()
    assert drafted == plain
    assert stats["spec_drafter"] == "mtp"
    accepted, verified_n = stats["spec_accepted_tokens"], stats["spec_draft_tokens"]
    assert 0 < accepted < verified_n  # drafts both taken and rejected
    assert len({p % 4 for p in rolled}) >= 2  # rollbacks at several compression phases
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    common = set(spec_states) & set(plain_states)
    assert [key for key in common if key[1] in rolled]  # states right after a rollback
    for key in common:
        for a, b in zip(spec_states[key], plain_states[key], strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


async def test_greedy_equal_with_overlap_after_a_prefix_hit(drafting, prompts, plain_run):
    """Overlap on, the same engine twice: the second run resumes the prompts from the prefix
    cache (the MTP state there is stale: acceptance may drop, the output may not)."""
    engine = await started(
        drafting, overlap=True, speculative="mtp", spec_policy="fixed", num_speculative_tokens=3
    )
    try:
        first = await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, PARAMS)))
        again = await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, PARAMS)))
        stats = engine.stats()
    finally:
        await engine.stop()
    assert list(first) == plain_run[0] and list(again) == plain_run[0]
    assert stats["prefix_hit_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def test_mtp_needs_a_v4_checkpoint_with_its_tensors(tmp_path):
    with pytest.raises(StartupError, match=r"speculative mtp: .*no mtp\.0\.\* tensors"):
        await started(make_v4_checkpoint(tmp_path / "plain"), speculative="mtp")
    dense = make_dense_checkpoint(tmp_path / "dense")
    with pytest.raises(StartupError, match="speculative mtp: the model has no MTP layers"):
        await started(dense, speculative="mtp")


SAMPLE_VOCAB = 8
SAMPLED = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)


async def test_sampled_tokens_are_distributed_as_the_target(tmp_path):
    """The first two output tokens of many sampled requests: the second is the MTP layer's
    draft (random weights), taken or redrawn by rejection sampling; their joint counts fit the
    target's p(t1) p(t2 | t1), computed by transformers."""
    path = add_v4_mtp_tensors(make_v4_checkpoint(tmp_path / "v4", vocab_size=SAMPLE_VOCAB))
    prompt, n = [2, 5, 3], 512
    engine = await started(
        path,
        speculative="mtp",
        spec_policy="fixed",
        num_speculative_tokens=2,
        max_num_seqs=128,
        kv_cache_memory_gb=0.05,
    )
    try:
        outs = await run_all(engine, [prompt] * n, [SAMPLED] * n)
        stats = engine.stats()
    finally:
        await engine.stop()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    counts = first_pair_counts(outs, SAMPLE_VOCAB)
    ref = load_reference(path)
    with torch.no_grad():
        p1 = ref(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        follow = [ref(torch.tensor([prompt + [t]])).logits[0, -1] for t in range(SAMPLE_VOCAB)]
        p2 = torch.stack(follow).softmax(-1)
    joint = (p1[:, None] * p2).flatten()
    assert chi_square_ok(*lumped(counts, joint, n))
    # the test can fail: the target's first token with a uniform second does not fit
    uniform = (p1[:, None] * torch.full_like(p2, 1 / SAMPLE_VOCAB)).flatten()
    assert not chi_square_ok(*lumped(counts, uniform, n))
