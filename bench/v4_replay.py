"""Continuation cost after a DeepSeek-V4 prefix hit, by prefix length: exact resume (SWA snapshot
present), bounded replay (snapshot missing, policy `--policy`: "window" by default, the seed's
last-W-tokens replay; "replay" recomputes layers x (W-1) tokens) and full recompute (no prefix cache).

    python -m bench.v4_replay [--prefix 1024 4096 16384 --new-tokens 8 --repeats 9 --full-repeats 3]
                              [--skip-full] [--policy window|replay]

Per prefix length, turn 1 (a random prefix, max_tokens=1) fills the block cache and stores the SWA
snapshot at its last block boundary. Then, per repeat, turn 2 = prefix + a few fresh tokens with
max_tokens=1 is timed (submit to its one token) three ways: turn 1's snapshot put back (exact
resume), every snapshot dropped (bounded replay), and on an engine without prefix caching
(`--skip-full` leaves that one out: at 16K it takes tens of seconds a run).

The model's hidden (and expert) width is 512 by default: what a replay costs beyond the
prefix-independent work is the lightning indexer scoring every compressed entry, so the ratio
of the indexer's work to the model's sets how a replay grows with the prefix. At 16K tokens
that ratio is 4.8% for DeepSeek-V4-Flash, 20% at hidden 512 and 151% at hidden 128 (printed
at the start of every run; `--hidden 128` for the smaller model).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import machine, median, quiet_logs
from bench.v4_common import DeviceProfile, engine_threads, forward_threads, work_per_token
from bench.v4_kv_bytes import FLASH, default_layer_types
from daemon.models.deepseek_v4.config import V4Config

V4_REPLAY = dict(
    vocab_size=4096,
    hidden_size=128,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=64,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention"] * 2,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=128,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=64,
    hc_mult=2,
    partial_rotary_factor=0.25,
    max_position_embeddings=20480,
)

MODES = ("exact_resume", "replay", "full")


def indexer_share(c: dict[str, Any], context: int) -> str:
    """The bench model's and V4-Flash's indexer work against their model work, at `context`."""
    flash = {k: v for k, v in FLASH.items() if k != "torch_dtype"}
    flash["layer_types"] = default_layer_types(flash["num_hidden_layers"])
    parts = []
    for name, conf in (("this model", c), ("DeepSeek-V4-Flash", flash)):
        model, index = work_per_token(V4Config.from_hf(conf), context)
        parts.append(f"{name} {model / 1e6:,.1f} + {index / 1e6:,.2f} MFLOP ({index / model:.1%})")
    return f"per token at {context} tokens, model + indexer scoring: " + "; ".join(parts)


@dataclass
class Timings:
    seconds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    cached: dict[str, set[int]] = field(default_factory=lambda: {m: set() for m in MODES})
    tokens: dict[str, list[int]] = field(default_factory=lambda: {m: [] for m in MODES})
    turn1: list[float] = field(default_factory=list)  # one run: the prefix's first prefill


async def one_token(engine: Any, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds from submit to the request's only token, its cached tokens, and the token."""
    from daemon.loop.request import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    token, cached = -1, 0
    async for out in engine.generate(prompt, params):
        if out.new_token_ids:
            token = out.new_token_ids[0]
        cached = max(cached, out.num_cached_tokens)
    return time.perf_counter() - t0, cached, token


def forget_swa(engine: Any) -> None:
    """Simulate an SWA-cache miss: drop every stored snapshot (keeping the byte count right)."""
    swa = engine.scheduler.prefix.swa
    for key in list(swa.entries):
        swa.discard(key)


def put_back(engine: Any, stash: dict[bytes, Any]) -> None:
    """Bring back turn 1's own snapshots (a later turn may have replaced them)."""
    swa = engine.scheduler.prefix.swa
    for key, snap in stash.items():
        swa.discard(key)
        swa.entries[key] = snap
        swa.bytes += snap.nbytes


async def bench(args: argparse.Namespace) -> None:
    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine
    from daemon.models.checkpoints import make_v4_checkpoint

    quiet_logs()
    need = max(args.prefix) + args.new_tokens + 1
    if need > V4_REPLAY["max_position_embeddings"]:
        raise SystemExit(f"prefix {max(args.prefix)} needs max_position_embeddings >= {need}")
    root = Path(tempfile.mkdtemp(prefix="deepinfer-v4-replay-"))
    c = V4_REPLAY | dict(hidden_size=args.hidden, moe_intermediate_size=args.hidden)
    path = make_v4_checkpoint(root, weight_scale=0.1, **c)
    common: dict[str, Any] = dict(
        model=str(path),
        device="cpu",
        kv_cache_memory_gb=args.kv_gb,
        max_num_seqs=4,
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=need,
        swa_cache_ttl_s=1e9,  # turn 1's snapshots must outlive the whole run
        **engine_threads(args),
    )
    cached_engine, _ = build_engine(EngineConfig(**common, swa_miss_policy=args.policy))
    cold_engine = None
    if not args.skip_full:
        cold_engine, _ = build_engine(EngineConfig(**common, prefix_caching=False))
    modes = [m for m in MODES if not (args.skip_full and m == "full")]
    vocab = c["vocab_size"]
    print(
        f"model: V4 {c['num_hidden_layers']}L hidden {c['hidden_size']} heads "
        f"{c['num_attention_heads']}x{c['head_dim']} window {c['sliding_window']} rates 4/128, "
        f"fp32 | {machine()} | engine forward threads {forward_threads(cached_engine)} | "
        f"chunk {args.max_batched_tokens} tokens"
    )
    print(indexer_share(c, max(args.prefix)))
    rng = random.Random(0)
    results = {p: Timings() for p in args.prefix}
    prefixes = {p: [rng.randrange(2, vocab) for _ in range(p)] for p in args.prefix}
    stashes: dict[int, dict[bytes, Any]] = {}
    profiles: list[tuple[str, DeviceProfile]] = []
    engines = [e for e in (cached_engine, cold_engine) if e is not None]
    for engine in engines:
        await engine.start()
    try:
        # warm-up the engines (first-call paths, allocator): a prefill, a resume, a replay
        warm = [rng.randrange(2, vocab) for _ in range(384)]
        for engine in engines:
            await one_token(engine, warm)
        for _ in range(2):
            await one_token(cached_engine, warm + [rng.randrange(2, vocab) for _ in range(8)])
            forget_swa(cached_engine)
        rounds = max(args.repeats, 0 if args.skip_full else args.full_repeats)
        total = len(args.prefix) * (1 + rounds)
        with tqdm(total=total, desc="runs", leave=False) as bar:
            for p, prefix in prefixes.items():  # turn 1: blocks cached, snapshot stored
                forget_swa(cached_engine)
                t, _, _ = await one_token(cached_engine, prefix)
                results[p].turn1.append(t)
                stashes[p] = dict(cached_engine.scheduler.prefix.swa.entries)
                bar.update()
            for i in range(rounds):
                now = [m for m in modes if i < (args.full_repeats if m == "full" else args.repeats)]
                for p, prefix in prefixes.items():
                    r = results[p]
                    prompt = prefix + [rng.randrange(2, vocab) for _ in range(args.new_tokens)]
                    for mode in now:
                        forget_swa(cached_engine)
                        if mode == "exact_resume":
                            put_back(cached_engine, stashes[p])
                        engine = cold_engine if mode == "full" else cached_engine
                        t, cached, token = await one_token(engine, prompt)
                        r.seconds[mode].append(t)
                        r.cached[mode].add(cached)
                        r.tokens[mode].append(token)
                    bar.update()
        if args.profile:
            profiles = await profile_turns(cached_engine, cold_engine, prefixes, args, rng)
    finally:
        for engine in engines:
            await engine.stop()
    report(results, modes, args)
    if args.profile:
        for title, prof in profiles:
            print()
            print(prof.report(title, args.profile_top))


def report(results: dict[int, Timings], modes: list[str], args: argparse.Namespace) -> None:
    full = "full" in modes
    print(
        f"\nturn 2 = prefix + {args.new_tokens} new tokens, max_tokens=1: seconds from submit to "
        f"its token, medians over {args.repeats} repeats "
        + (f"({args.full_repeats} for full)" if full else "(full recompute skipped)")
    )
    print(
        f"{'prefix':>7} {'turn 1':>8} {'exact resume':>13} {'replay':>8} {'full':>8} "
        f"{'full/replay':>12}  cached tokens (exact / replay / full)"
    )
    for p, r in results.items():
        s = {m: median(v) for m, v in r.seconds.items() if v}
        cached = " / ".join(",".join(str(x) for x in sorted(r.cached[m])) for m in MODES)
        tail = (
            f"{s['full']:>8.3f} {s['full'] / s['replay']:>11.1f}x"
            if full
            else f"{'-':>8} {'-':>12}"
        )
        print(
            f"{p:>7} {median(r.turn1):>8.3f} {s['exact_resume']:>13.3f} {s['replay']:>8.3f} "
            f"{tail}  {cached}"
        )
    lo, hi = min(args.prefix), max(args.prefix)
    for mode in modes:
        grow = median(results[hi].seconds[mode]) / median(results[lo].seconds[mode])
        print(f"{mode:>13}: {hi}/{lo} time ratio {grow:.2f}x")
    # the full recompute is the truth; without it, exact resume (equal to it in every run)
    truth = "full" if full else "exact_resume"
    agree = {
        m: sum(a == b for r in results.values() for a, b in zip(r.tokens[m], r.tokens[truth]))
        / sum(len(r.tokens[truth]) for r in results.values())
        for m in ("exact_resume", "replay")
    }
    print(
        f"first token equal to {truth.replace('_', ' ')}: exact resume "
        f"{agree['exact_resume']:.0%}, bounded replay {agree['replay']:.0%} "
        "(random weights: a worst case for replay)"
    )


async def profile_turns(
    cached_engine: Any,
    cold_engine: Any | None,
    prefixes: dict[int, list[int]],
    args: argparse.Namespace,
    rng: random.Random,
) -> list[tuple[str, DeviceProfile]]:
    """cProfile of the device thread: the replay turn 2 at the shortest and the longest prefix,
    and the full recompute at the longest (unless skipped)."""
    vocab = V4_REPLAY["vocab_size"]
    lo, hi = min(prefixes), max(prefixes)
    out = []
    for p in sorted({lo, hi}):
        prompt = prefixes[p] + [rng.randrange(2, vocab) for _ in range(args.new_tokens)]
        forget_swa(cached_engine)
        with DeviceProfile(cached_engine, lambda _: True) as replay:
            await one_token(cached_engine, prompt)
        out.append((f"turn 2 after an SWA miss, bounded replay, prefix {p}", replay))
    if cold_engine is None:
        return out
    prompt = prefixes[hi] + [rng.randrange(2, vocab) for _ in range(args.new_tokens)]
    with DeviceProfile(cold_engine, lambda _: True) as full:
        await one_token(cold_engine, prompt)
    out.append((f"turn 2, full recompute of {len(prompt)} tokens", full))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9, help="runs of exact resume and replay")
    p.add_argument("--full-repeats", type=int, default=3, help="runs of the full recompute")
    p.add_argument(
        "--skip-full", action="store_true", help="leave the full recompute out (minutes at 16K)"
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=512,
        help="hidden and expert width: the per-token work (see above)",
    )
    p.add_argument(
        "--policy",
        choices=("window", "replay"),
        default="window",
        help="SWA-miss policy of the replay runs: window (the last W tokens, the seed's) or "
        "replay (layers x (W-1) tokens, exact)",
    )
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--profile", action="store_true", help="then cProfile replay and full recompute")
    p.add_argument(
        "--profile-top", type=int, default=0, help="also the N top functions by self time"
    )
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads of the main thread (0 = default)"
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=0,
        help="EngineConfig.cpu_threads, the engine's forward threads (0 = the engine's choice)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
