"""MoE runtime costs on the small random DeepSeek-V4 of bench.v4_throughput (16 experts):
(1) expert-load statistics on the decode step: the same decode run with statistics off, at
the default interval (1000 steps) and sampled every step (the worst case), in rotating order,
median ratios; (2) the time to apply a live rebalance on a real 2-process gloo EP group.

    python -m bench.moe_runtime [--batch 16 --tokens 48 --repeats 5 --ranks 2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import machine, quiet_logs
from bench.v4_throughput import make_bench_checkpoint
from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.request import SamplingParams


def _prompts(batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 32000, (32,), generator=g).tolist() for _ in range(batch)]


async def _decode_seconds(engine, batch: int, tokens: int, seed: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(p: list[int]) -> None:
        async for _ in engine.generate(p, params):
            pass

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in _prompts(batch, seed)))
    return time.perf_counter() - start


async def stats_cost(checkpoint: Path, batch: int, tokens: int, repeats: int) -> dict:
    cfg = EngineConfig(model=str(checkpoint), kv_cache_memory_gb=0.5, prefix_caching=False)
    engine, _ = build_engine(cfg)
    await engine.start()
    modes = {"off": 0, "default": 1000, "every step": 1}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    try:
        await _decode_seconds(engine, batch, 4, 0)  # warm-up
        for r in tqdm(range(repeats), desc="statistics off / default / every step"):
            order = list(modes)[r % 3 :] + list(modes)[: r % 3]
            for mode in order:
                engine.moe.set_intervals(modes[mode], 0)
                seconds[mode].append(await _decode_seconds(engine, batch, tokens, 100 + r))
    finally:
        await engine.stop()
    off = seconds["off"]
    return {
        mode: (statistics.median(s), statistics.median(a / b for a, b in zip(s, off)))
        for mode, s in seconds.items()
    }


def _rank(checkpoint: str, size: int, rank: int, port: int, queue) -> None:
    quiet_logs()
    cfg = EngineConfig(
        model=checkpoint,
        kv_cache_memory_gb=0.5,
        prefix_caching=False,
        ep_size=size,
        ep_rank=rank,
        ep_master=f"127.0.0.1:{port}",
        moe_stats_interval=4,
        moe_rebalance_interval=0,
    )

    async def main() -> dict:
        engine, _ = build_engine(cfg)
        await engine.start()
        try:
            await _decode_seconds(engine, 8, 24, rank)
            if rank == 0:
                engine.moe.request_rebalance()
            await _decode_seconds(engine, 8, 8, 10 + rank)
        finally:
            await engine.stop()
        return engine.moe.status()

    queue.put(asyncio.run(main()))


def rebalance_time(checkpoint: Path, size: int) -> dict:
    from daemon.service.live_server import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(str(checkpoint), size, r, port, queue)) for r in range(size)
    ]
    for p in procs:
        p.start()
    statuses = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    done = [s["last_rebalance"] for s in statuses if s["last_rebalance"]]
    return {
        "ranks": size,
        "seconds": max(d["seconds"] for d in done),
        "moved_slots": done[0]["moved_slots"],
        "moe_layers": statuses[0]["moe_layers"],
        "slots_per_rank": statuses[0]["slots_per_rank"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    quiet_logs()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_bench_checkpoint(Path(tmp) / "v4")
        cost = asyncio.run(stats_cost(checkpoint, args.batch, args.tokens, args.repeats))
        rebalance = rebalance_time(checkpoint, args.ranks)
    print(machine())
    print(f"decode of {args.batch} x {args.tokens} tokens, median of {args.repeats}:")
    for mode, (secs, ratio) in cost.items():
        print(
            f"  statistics {mode:>10}: {secs:.2f} s  ratio to off {ratio:.4f} ({(ratio - 1) * 100:+.2f} %)"
        )
    print(
        f"live rebalance over {rebalance['ranks']} gloo ranks: {rebalance['seconds'] * 1000:.1f} ms, "
        f"{rebalance['moved_slots']} slots moved ({rebalance['moe_layers']} MoE layers, "
        f"{rebalance['slots_per_rank']} slots per rank)"
    )


if __name__ == "__main__":
    main()
