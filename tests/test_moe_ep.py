"""Expert parallelism over 2 and 4 gloo ranks (real processes, one engine each, each serving
its own requests) gives the single-rank outputs, also across a live rebalance requested in
the middle of generation."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import orjson
import pytest
import torch

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.request import SamplingParams
from daemon.service.daemon import EXIT_ENGINE_FAILED
from tests.checkpoints import make_v4_checkpoint
from tests.daemons import free_port, spawn, wait_healthy

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


def test_a_rank_whose_peer_dies_exits_for_its_supervisor(checkpoint: Path, tmp_path: Path) -> None:
    """Two EP daemons; rank 1 is killed. Rank 0's lockstep agreement fails (the peer's
    connections reset), its engine fails with it while idle, and the daemon exits 4 for
    systemd to restart it; before, rank 0 stayed up with a dead worker and hung every request."""
    master = free_port()
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for rank in range(2):
        args = [
            "--model", str(checkpoint), "--device", "cpu", "--kv-cache-memory-gb", "0.01",
            "--no-kv-store", "--log-format", "json", "--ep-size", "2", "--ep-rank", str(rank),
            "--ep-master", f"127.0.0.1:{master}",
        ]  # fmt: skip
        procs.append(spawn(ports[rank], args, logs[rank]))
    try:
        for rank in range(2):
            wait_healthy(f"http://127.0.0.1:{ports[rank]}", procs[rank], 180)
        procs[1].kill()
        assert procs[0].wait(timeout=60) == EXIT_ENGINE_FAILED
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    events = [
        orjson.loads(line)["event"] for line in logs[0].read_text().splitlines() if line[:1] == "{"
    ]
    failed = events.index("ep_lockstep_failed")
    assert events[failed:] == ["ep_lockstep_failed", "engine_failed_exiting", "stopped"]
