"""Prefix-cache hit rate of input tokens, by tier, on multi-turn agent or chat traces
(daemon/benchmark/traces.py) replayed through the engine in-process on a tiny random dense model.

    python -m bench.kv_hit_rate [--kind agent --sessions 4 --time-scale 0.01
        --configs default host store --kv-gb 0.004 --host-gb 4 --model dense --json out.json]

Configurations: `default` = EngineConfig's sizing (1 GB device pool, 4 GB host tier) plus a
block store in a temp dir; `host` = a device pool of --kv-gb with the host tier, no store;
`store` = the same small pool, no host tier, the block store. The ceiling counts the prompt
tokens an earlier request had computed, in whole blocks (daemon.benchmark.traces.PrefixCeiling).
`--model v4`: a tiny random DeepSeek-V4 with V4-Flash's window (128) and compress rates (4 / 128,
so 128-token blocks), to measure its sliding-window tier too: the SWA snapshot hit rate of
admissions that found cached blocks, and the host memory the snapshots take (here, and at
V4-Flash's 5.33 MiB per snapshot).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import ModelSpec, machine, make_checkpoint, parse_range, quiet_logs
from daemon.benchmark.traces import (
    DEFAULTS,
    KINDS,
    PrefixCeiling,
    Session,
    Turn,
    describe,
    make_trace,
    sessions,
)

TIERS = ("device", "host", "store")
# as small as the engine allows: hit rates do not depend on the model, run time does
SPEC = ModelSpec(
    num_layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=4096,
    max_positions=65536,
)  # fmt: skip


V4_SPEC = dict(
    vocab_size=SPEC.vocab, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=2, head_dim=32, q_lora_rank=16, o_groups=1, o_lora_rank=16,
    n_routed_experts=2, num_experts_per_tok=1, index_n_heads=2, index_head_dim=16, index_topk=8,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["moe", "moe"], sliding_window=128,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    max_position_embeddings=SPEC.max_positions,
)  # fmt: skip
V4_FLASH_SNAPSHOT_BYTES = 43 * 127 * 512 * 2  # layers x (window - 1) x head_dim x bf16


def make_v4_checkpoint() -> Path:
    from daemon.models.checkpoints import make_v4_checkpoint as make

    root = Path(tempfile.mkdtemp(prefix="deepinfer-bench-v4-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return make(root, **V4_SPEC)


@dataclass(frozen=True)
class RunConfig:
    name: str
    kv_gb: float
    host_gb: float
    store: bool


@dataclass
class TurnResult:
    session: int
    index: int
    prompt_tokens: int
    ceiling_tokens: int
    cached: dict[str, int]
    latency_s: float


@dataclass
class RunResult:
    config: RunConfig
    device_capacity_tokens: int
    host_capacity_tokens: int
    peak_live_tokens: int  # the most conversation tokens of sessions in progress at once
    wall_s: float
    preemptions: int
    turns: list[TurnResult] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def rates(self) -> dict[str, float]:
        prompt = max(sum(t.prompt_tokens for t in self.turns), 1)
        by_tier = {k: sum(t.cached.get(k, 0) for t in self.turns) / prompt for k in TIERS}
        hit = sum(by_tier.values())
        ceiling = sum(t.ceiling_tokens for t in self.turns) / prompt
        return {"hit": hit, **by_tier, "ceiling": ceiling, "of_ceiling": hit / max(ceiling, 1e-9)}


async def replay(engine: Any, groups: list[Session], scale: float, block: int) -> RunResult:
    """Every session as a task: wait for its turn, send the prompt, collect the answer."""
    from daemon.loop.request import SamplingParams

    ceiling = PrefixCeiling(block)
    results: list[TurnResult] = []
    live = peak = 0
    bar = tqdm(total=sum(len(s.turns) for s in groups), unit="turn", leave=False)
    t0 = time.perf_counter()

    async def run(s: Session) -> None:
        nonlocal live, peak
        await asyncio.sleep(s.turns[0].arrival_s * scale)
        while not s.done:
            if s.next_turn:
                await asyncio.sleep(s.turns[s.next_turn].think_time_s * scale)
            turn, prompt = s.prompt()
            live += len(turn.new_tokens) + turn.max_tokens
            peak = max(peak, live)
            hittable = ceiling.hittable(prompt)
            ceiling.computed(prompt)
            params = SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)
            sent = time.perf_counter()
            req = engine.add_request(prompt, params, traffic_class=turn.traffic_class)
            answer: list[int] = []
            cached: dict[str, int] = {}
            async for out in engine.stream(req):
                answer.extend(out.new_token_ids)
                cached = out.cached_tokens_by_tier or cached
            if len(answer) != turn.max_tokens:
                raise RuntimeError(f"asked for {turn.max_tokens} tokens, got {len(answer)}")
            ceiling.computed(prompt + answer[:-1])
            s.answered(answer)
            results.append(
                TurnResult(
                    turn.session,
                    turn.index,
                    len(prompt),
                    hittable,
                    dict(cached),
                    time.perf_counter() - sent,
                )
            )
            bar.update()
        live -= len(s.history)

    await asyncio.gather(*(run(s) for s in groups))
    bar.close()
    return RunResult(RunConfig("", 0, 0, False), 0, 0, peak, time.perf_counter() - t0, 0, results)


async def run_config(cfg: RunConfig, path: Path, trace: list[Turn], scale: float) -> RunResult:
    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    store_dir = tempfile.mkdtemp(prefix="deepinfer-kvstore-") if cfg.store else None
    try:
        engine, _ = build_engine(
            EngineConfig(
                model=str(path),
                device="cpu",
                kv_cache_memory_gb=cfg.kv_gb,
                host_cache_memory_gb=cfg.host_gb,
                kv_store_dir=store_dir,
            )
        )
        prefix = engine.scheduler.prefix
        longest = max(
            sum(len(t.new_tokens) + t.max_tokens for t in s.turns) for s in sessions(trace)
        )
        if longest > engine.kv.capacity_tokens():
            raise SystemExit(
                f"{cfg.name}: a session reaches {longest} tokens, the device pool holds "
                f"{engine.kv.capacity_tokens()}; raise --kv-gb"
            )
        await engine.start()
        try:
            result = await replay(engine, sessions(trace), scale, prefix.block)
        finally:
            await engine.stop()
        block_tokens = prefix.block
        host_blocks = prefix.host.max_bytes // prefix.block_bytes if prefix.host is not None else 0
        return replace(
            result,
            config=cfg,
            device_capacity_tokens=engine.kv.capacity_tokens(),
            host_capacity_tokens=host_blocks * block_tokens,
            preemptions=engine.scheduler.num_preemptions,
            stats=engine.stats() | {"swa_snapshot_bytes": prefix.swa_bytes},
        )
    finally:
        if store_dir:
            shutil.rmtree(store_dir, ignore_errors=True)


def tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def report(runs: list[RunResult]) -> None:
    print(
        "| config | device pool | host tier | store | peak live | hit rate | device | host "
        "| store | ceiling | hit/ceiling | preemptions | wall |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        x, c = r.rates(), r.config
        host = tokens(r.host_capacity_tokens) if c.host_gb else "off"
        print(
            f"| {c.name} | {c.kv_gb:g} GB = {tokens(r.device_capacity_tokens)} tok "
            f"| {host} | {'on' if c.store else 'off'} | {tokens(r.peak_live_tokens)} "
            f"| **{x['hit']:.2%}** | {x['device']:.2%} | {x['host']:.2%} | {x['store']:.2%} "
            f"| {x['ceiling']:.2%} | {x['of_ceiling']:.2%} | {r.preemptions} | {r.wall_s:.0f} s |"
        )
    for r in runs:
        s = r.stats
        if "swa_hits" in s:
            lookups = s["swa_hits"] + s["swa_misses"]
            one = s["swa_snapshot_bytes"]
            peak = s["swa_cache_peak_bytes"] // one
            print(
                f"{r.config.name}: SWA snapshot hit rate **{s['swa_hit_rate']:.2%}** "
                f"({s['swa_hits']}/{lookups} admissions on cached blocks); "
                f"{s['swa_cache_saves']} snapshots taken, {s['swa_cache_evictions']} evicted; "
                f"host memory peak {peak} snapshots = {s['swa_cache_peak_bytes'] / 2**20:.1f} MiB "
                f"here ({one:,} B each), {peak * V4_FLASH_SNAPSHOT_BYTES / 2**30:.2f} GiB at "
                f"V4-Flash's {V4_FLASH_SNAPSHOT_BYTES / 2**20:.2f} MiB; at the end "
                f"{s['swa_cache_snapshots']} = {s['swa_cache_bytes'] / 2**20:.1f} MiB"
            )
        print(
            f"{r.config.name}: engine prefix_token_hit_rate {s.get('prefix_token_hit_rate', 0):.2%}; "
            + ", ".join(
                f"{t} {s.get(f'prefix_{t}_hits', 0)}/{s.get(f'prefix_{t}_lookups', 0)} blocks"
                for t in TIERS
            )
            + f"; host read {s.get('prefix_host_bytes_read', 0) / 2**20:.0f} MiB, "
            f"store read {s.get('prefix_store_bytes_read', 0) / 2**20:.0f} MiB, "
            f"written {s.get('prefix_store_bytes_written', 0) / 2**20:.0f} MiB "
            f"({s.get('kv_store_writes', 0)} blocks, {s.get('kv_store_dropped_writes', 0)} dropped)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=KINDS, default="agent")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=parse_range, default=None, help="turns per session, LO-HI")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=0.01,
        help="multiplies session starts and think times (not the engine's own time)",
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        choices=("default", "host", "store"),
        default=["default", "host", "store"],
    )
    ap.add_argument("--kv-gb", type=float, default=0.004, help="device pool of host/store runs")
    ap.add_argument("--host-gb", type=float, default=4.0, help="host tier of the host run")
    ap.add_argument(
        "--model",
        choices=("dense", "v4"),
        default="dense",
        help="v4: a tiny DeepSeek-V4 (window 128, rates 4/128), its SWA tier measured too",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    quiet_logs()

    p = DEFAULTS[args.kind]
    if args.turns:
        p = replace(p, turns=args.turns)
    trace = make_trace(args.kind, args.sessions, args.seed, SPEC.vocab, p)
    summary = describe(trace)
    assert p.max_context_tokens <= SPEC.max_positions
    model = SPEC.describe() if args.model == "dense" else f"tiny DeepSeek-V4 {V4_SPEC}"
    print(f"model: {model}, {machine()}")
    print(
        f"trace: {args.kind}, {summary['sessions']} sessions, {summary['turns']} turns "
        f"({summary['turns_per_session']:.1f} per session), {summary['prompt_tokens']:,} prompt "
        f"tokens, final context mean {summary['mean_final_context']:,.0f} / max "
        f"{summary['max_context']:,}; time scale {args.time_scale:g} (think times "
        f"{p.think_time_s[0] * args.time_scale:g}-{p.think_time_s[1] * args.time_scale:g} s, "
        f"starts over {p.start_window_s * args.time_scale:g} s); nominal ceiling "
        f"{summary['ceiling']:.2%}"
    )
    configs = {
        "default": RunConfig("default", 1.0, 4.0, True),
        "host": RunConfig("host", args.kv_gb, args.host_gb, False),
        "store": RunConfig("store", args.kv_gb, 0.0, True),
    }
    path = make_checkpoint(SPEC) if args.model == "dense" else make_v4_checkpoint()
    runs = []
    for name in args.configs:
        run = asyncio.run(run_config(configs[name], path, trace, args.time_scale))
        runs.append(run)
        print(f"{name}: {run.rates()['hit']:.2%} in {run.wall_s:.0f} s")
    report(runs)
    if args.json:
        out = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "trace": summary,
            "runs": [
                {
                    "config": asdict(r.config),
                    "rates": r.rates(),
                    "device_capacity_tokens": r.device_capacity_tokens,
                    "host_capacity_tokens": r.host_capacity_tokens,
                    "peak_live_tokens": r.peak_live_tokens,
                    "wall_s": r.wall_s,
                    "preemptions": r.preemptions,
                    "stats": r.stats,
                }
                for r in runs
            ],
        }
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
