"""Expert parallelism over 2 and 4 gloo ranks (real processes, one engine each, each serving
its own requests) gives the single-rank outputs, also across a live rebalance requested in
the middle of generation."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
import torch

from daemon.build import build_engine
from daemon.config import EngineConfig
from daemon.loop.request import SamplingParams
from tests.checkpoints import make_v4_checkpoint
from tests.daemons import free_port

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
NUM_PROMPTS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # 8 experts so that 2 and 4 ranks each hold several, plus replicas
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4-moe"), n_routed_experts=8)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (9, 30, 17, 44, 5, 23)]


def settings(checkpoint: Path, **overrides) -> EngineConfig:
    # gloo on the CPU: also on a machine with one GPU, which NCCL ranks could not share
    base = dict(
        model=str(checkpoint), device="cpu", kv_cache_memory_gb=0.01, max_num_seqs=8, overlap=True
    )
    return EngineConfig(**(base | overrides))


async def _generate(
    cfg: EngineConfig, mine: list[int], rebalance_at: int | None
) -> tuple[dict, dict]:
    engine, _ = build_engine(cfg)
    await engine.start()
    all_prompts = prompts()

    async def one(i: int) -> list[int]:
        tokens = []
        async for out in engine.generate(all_prompts[i], GREEDY):
            tokens += out.new_token_ids
            if rebalance_at is not None and i == mine[0] and len(tokens) == rebalance_at:
                engine.moe.request_rebalance()
        return tokens

    try:
        results = await asyncio.gather(*(one(i) for i in mine))
    finally:
        await engine.stop()
    return dict(zip(mine, results, strict=True)), engine.moe.status()


def _rank(
    checkpoint: str, size: int, rank: int, port: int, rebalance_rank: int | None, queue
) -> None:
    cfg = settings(
        Path(checkpoint),
        ep_size=size,
        ep_rank=rank,
        ep_master=f"127.0.0.1:{port}",
        moe_stats_interval=2,
    )
    mine = (
        list(range(rank, NUM_PROMPTS, size))
        if rank < size - 1
        else list(range(rank, NUM_PROMPTS, size))[:1]
    )
    at = 6 if rank == rebalance_rank else None
    try:
        queue.put((rank, *asyncio.run(_generate(cfg, mine, at))))
    except BaseException as e:
        queue.put((rank, repr(e), None))
        raise


@pytest.fixture(scope="module")
def single_rank(checkpoint: Path) -> dict[int, list[int]]:
    outputs, _ = asyncio.run(_generate(settings(checkpoint), list(range(NUM_PROMPTS)), None))
    return outputs


@pytest.mark.parametrize(("size", "rebalance_rank"), [(2, None), (2, 1), (4, 0)])
def test_expert_parallel_equals_single_rank(checkpoint, single_rank, size, rebalance_rank) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(str(checkpoint), size, r, port, rebalance_rank, queue))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    got: dict[int, list[int]] = {}
    for _, outputs, status in sorted(results, key=lambda r: r[0]):
        assert status is not None, outputs
        got |= outputs
        assert status["ep_size"] == size and status["steps"] > 0
        if rebalance_rank is not None:
            assert status["placement_version"] >= 1
            assert status["last_rebalance"]["moved_slots"] > 0
    assert got == {i: single_rank[i] for i in got}
    assert len(got) >= size
