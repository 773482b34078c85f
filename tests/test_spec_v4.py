"""Speculative decoding on a tiny random DeepSeek-V4 (window 8, compression every 4 and 8
tokens): greedy output equal to no speculation beside a request that does not speculate, with
drafts rejected across compression and block boundaries; after each rollback the request's
ring and compressor state is the one a run that never drafted has at that position."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.engine import Engine
from daemon.loop.request import RequestOutput, RequestStatus, SamplingParams
from tests.checkpoints import make_v4_checkpoint
from tests.spec_doubles import OracleDrafter, speculate

VOCAB = 512
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PENALISED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4-spec"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 14, 30)]


async def started(checkpoint: Path, **overrides) -> Engine:
    settings = dict(model=str(checkpoint), kv_cache_memory_gb=0.01, max_num_seqs=4, overlap=False)
    engine, _ = build_engine(EngineConfig(**(settings | overrides)))
    await engine.start()
    return engine


async def collect(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    outs: list[RequestOutput] = [o async for o in engine.generate(prompt, params)]
    return [t for o in outs for t in o.new_token_ids]


def record_states(engine: Engine) -> dict[tuple[tuple[int, ...], int], list[torch.Tensor]]:
    """After each processed step (overlap off: the device is idle): each running request's
    per-request state, by (prompt, positions computed)."""
    states: dict[tuple[tuple[int, ...], int], list[torch.Tensor]] = {}
    process, cache, kv = engine._process, engine.runner.cache, engine.kv

    def recording(step, result) -> None:
        process(step, result)
        for seq in step.seqs:
            req = seq.request
            if req.status == RequestStatus.RUNNING and req.num_inflight_steps == 0:
                snap = cache.snapshot(kv.block_tables(req.request_id), req.num_computed)
                states[(tuple(req.prompt_ids), req.num_computed)] = read_part(
                    cache, snap.tensors, req.num_computed
                )

    engine._process = recording
    return states


def record_rollbacks(engine: Engine) -> list[int]:
    """The position each verify rolled its request's state back to (where it rolled back)."""
    rolled: list[int] = []
    verified = engine.scheduler.verified

    def noting(seq, accepted, state_at):
        if state_at is not None:
            rolled.append(state_at)
        verified(seq, accepted, state_at)

    engine.scheduler.verified = noting
    return rolled


def read_part(cache, tensors: list[torch.Tensor], position: int) -> list[torch.Tensor]:
    """The state a next step reads: the rings whole (each layer's, first), and of each
    compressor's open-window buffers only the rows of the positions in that window so far
    (rows past them are left from earlier windows, by whichever path wrote those: decode rows
    write every row, a chunk only those of the window it leaves open)."""
    layers = len(cache.swa)
    rings, rest = tensors[:layers], iter(tensors[layers:])
    out = list(rings)
    for st in [*cache.layers.values(), *cache.indexers.values()]:
        m = st.buf_kv.shape[1]
        out += [next(rest)[: position % m], next(rest)[: position % m]]
        if st.ovl_kv is not None:
            out += [next(rest), next(rest)]
    return out


async def test_greedy_equal_and_rollback_leaves_no_trace(checkpoint, prompts):
    """Two fresh engines (the same blocks, zeroed, in the same order), one with drafts."""
    params = [GREEDY, PENALISED, GREEDY]
    engine = await started(checkpoint)
    try:
        plain_states = record_states(engine)
        plain = await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, params)))
    finally:
        await engine.stop()
    engine = await started(checkpoint)
    reference = {tuple(p): t for p, t in zip(prompts, plain)}
    drafter = OracleDrafter(reference, VOCAB)
    speculate(engine, drafter, k=4)
    rolled = record_rollbacks(engine)
    try:
        spec_states = record_states(engine)
        drafted = await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, params)))
        stats = engine.stats()
    finally:
        await engine.stop()
    assert drafted == plain
    assert tuple(prompts[1]) in drafter.asked  # the penalised request speculates too
    assert any(a < v for v, a in drafter.observed) and any(a > 0 for _, a in drafter.observed)
    # rejections rolled the state back at positions all around the compression windows
    assert len({p % 4 for p in rolled}) == 4
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    common = set(spec_states) & set(plain_states)
    assert [key for key in common if key[1] in rolled]  # states right after a rollback
    for key in common:
        for a, b in zip(spec_states[key], plain_states[key], strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


async def test_greedy_equal_with_overlap_after_a_prefix_hit(checkpoint, prompts):
    """Overlap on, the same engine twice: the drafting run resumes the prompts from the
    prefix cache (blocks and SWA snapshots) and verifies from there."""
    engine = await started(checkpoint, overlap=True)
    try:
        plain = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
        drafter = OracleDrafter({tuple(p): t for p, t in zip(prompts, plain)}, VOCAB)
        speculate(engine, drafter, k=4)
        drafted = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
        stats = engine.stats()
    finally:
        await engine.stop()
    assert drafted == plain
    assert stats["prefix_hit_tokens"] > 0
    assert any(a < v for v, a in drafter.observed) and any(a > 0 for _, a in drafter.observed)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
