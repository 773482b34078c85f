"""DeepSeek-V4 prefix reuse inside one node: exact resume from cached block state plus the
stored sliding-window state, and the two SWA-miss policies (bounded replay, exact)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.build import build_engine
from daemon.config import EngineConfig
from daemon.loop.engine import Engine
from daemon.loop.request import SamplingParams
from tests.checkpoints import make_v4_checkpoint

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4"))


async def engine_for(checkpoint: Path, **overrides) -> Engine:
    settings = dict(model=str(checkpoint), kv_cache_memory_gb=0.01, max_num_seqs=4)
    engine, _ = build_engine(EngineConfig(**(settings | overrides)))
    await engine.start()
    return engine


async def turn(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for out in engine.generate(prompt, GREEDY):
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
    return tokens, cached


async def conversation(engine: Engine, forget_swa: bool = False) -> list[tuple[list[int], int]]:
    """Three turns, each prompt extending the previous prompt and answer."""
    g = torch.Generator().manual_seed(11)
    prompt: list[int] = []
    results = []
    for n_new in (37, 11, 20):
        prompt = prompt + torch.randint(2, 512, (n_new,), generator=g).tolist()
        answer, cached = await turn(engine, prompt)
        results.append((answer, cached))
        prompt = prompt + answer
        if forget_swa:
            engine.scheduler.prefix.swa.entries.clear()
    return results


async def test_resume_from_cached_prefix_is_exact(checkpoint: Path) -> None:
    cold = await engine_for(checkpoint, prefix_caching=False)
    warm = await engine_for(checkpoint)
    try:
        expected = await conversation(cold)
        got = await conversation(warm)
    finally:
        await cold.stop()
        await warm.stop()
    assert [a for a, _ in got] == [a for a, _ in expected]
    # turn 2 resumes at the last 8-token boundary of turn 1's 37 + 24 tokens
    assert [c for _, c in got] == [0, 56, 88]
    assert warm.scheduler.prefix.swa.hits == 2


async def test_swa_miss_exact_policy_recomputes(checkpoint: Path) -> None:
    cold = await engine_for(checkpoint, prefix_caching=False)
    exact = await engine_for(checkpoint, swa_miss_policy="exact")
    try:
        expected = await conversation(cold)
        got = await conversation(exact, forget_swa=True)
    finally:
        await cold.stop()
        await exact.stop()
    assert [a for a, _ in got] == [a for a, _ in expected]
    assert [c for _, c in got] == [0, 0, 0]


async def test_swa_miss_bounded_replay(checkpoint: Path) -> None:
    cold = await engine_for(checkpoint, prefix_caching=False)
    replay = await engine_for(checkpoint, swa_miss_policy="replay")
    try:
        expected = await conversation(cold)
        got = await conversation(replay, forget_swa=True)
    finally:
        await cold.stop()
        await replay.stop()
    # the window (8 tokens) before each boundary is recomputed, the blocks before it reused
    assert [c for _, c in got] == [0, 56 - 8, 88 - 8]
    agree = [sum(x == y for x, y in zip(a, b)) / len(a) for (a, _), (b, _) in zip(got, expected)]
    print("greedy agreement per turn", agree)
