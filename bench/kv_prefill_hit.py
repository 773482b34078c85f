"""Prefill cost of a long prompt on a full prefix-cache hit (from the device, host memory or the
block store) vs a miss: time to first token and prompt tokens per second, in one run.

    python -m bench.kv_prefill_hit [--prompt-len 8192 --repeats 3 --store-dir DIR] [--v4]

Engine A (host tier and block store on; the device pool holds one prompt and one block): per
round, prompt P_r misses, then hits on the device, then P_{r-1} hits in host memory (P_r's miss
needed every device block, so P_{r-1} went to host memory). Engine B (a fresh engine on the same
store directory, host tier off) then reads each prompt's blocks back from the store files, with
the page cache dropped first. One output token per request (greedy, ignore_eos).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import ModelSpec, machine, make_checkpoint, median, quiet_logs
from bench.kv_store_bandwidth import drop_page_cache

DENSE = ModelSpec(num_layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1536, vocab=32000)
KINDS = ("miss", "device", "host", "store")


@dataclass
class Sample:
    ttft: float
    tiers: dict[str, int]


@dataclass
class Results:
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {k: [] for k in KINDS})
    cache_drop: set[str] = field(default_factory=set)
    store_reads: list[float] = field(default_factory=list)  # load_chain seconds per store hit
    store_bytes: int = 0


async def first_token(engine: Any, prompt: list[int]) -> Sample:
    """Seconds from submitting `prompt` to its first token, and its cached tokens per tier.
    Earlier requests' cache work is let finish first (not timed)."""
    from daemon.loop.request import SamplingParams

    store = engine.scheduler.prefix.store
    for _ in range(2):  # device->host copies run while idle, then their store writes
        await asyncio.sleep(0.1)
        if store is not None:
            await store.flush()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    req = engine.add_request(prompt, params)
    ttft, tiers = None, {}
    async for out in engine.stream(req):
        if out.new_token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        tiers = out.cached_tokens_by_tier or tiers
    assert ttft is not None
    return Sample(ttft, dict(tiers))


def pool_gb(model_dir: Path, tokens: int, block_size: int, max_num_seqs: int) -> float:
    """KV memory for a device pool of exactly enough blocks for `tokens` tokens (+ per-request
    state), from the model's KV groups (built on the meta device, no weights)."""
    from daemon.models.loader import MODEL_TYPES, read_config

    hf = read_config(model_dir)
    config_cls, model_cls = MODEL_TYPES[hf["model_type"]]
    with torch.device("meta"):
        model = model_cls(config_cls.from_hf(hf), torch.device("cpu"))
    groups = model.kv_groups(torch.float32, block_size)
    paged = [g.spec for g in groups if not g.spec.per_request]
    block = max(s.block_size for s in paged)
    blocks = -(-tokens // block)
    fixed = sum(g.spec.bytes_per_block for g in groups if g.spec.per_request) * max_num_seqs
    per_token = sum(s.bytes_per_block / s.block_size for s in paged)
    return (fixed + (blocks + 0.5) * block * per_token) / 2**30  # +0.5: no rounding down


def checkpoint(args: argparse.Namespace, root: Path) -> tuple[Path, int, str]:
    if args.v4:
        from bench.v4_replay import V4_REPLAY
        from daemon.models.checkpoints import make_v4_checkpoint

        c = V4_REPLAY | dict(max_position_embeddings=max(20480, args.prompt_len + 16))
        path = make_v4_checkpoint(root, weight_scale=0.1, **c)
        desc = (
            f"V4 {c['num_hidden_layers']}L hidden {c['hidden_size']} heads "
            f"{c['num_attention_heads']}x{c['head_dim']} window {c['sliding_window']} fp32"
        )
        return path, c["vocab_size"], desc
    spec = ModelSpec(**{**vars(DENSE), "max_positions": max(16384, args.prompt_len + 16)})
    return make_checkpoint(spec, root), spec.vocab, spec.describe()


async def bench(args: argparse.Namespace) -> Results:
    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    quiet_logs()
    root = Path(tempfile.mkdtemp(prefix="deepinfer-prefill-hit-"))
    store_dir = Path(tempfile.mkdtemp(prefix="prefill-hit-", dir=args.store_dir or root))
    try:
        path, vocab, desc = checkpoint(args, root / "model")
        n = args.prompt_len
        common: dict[str, Any] = dict(
            model=str(path),
            device="cpu",
            kv_cache_memory_gb=pool_gb(path, n + 1, args.block_size, args.max_num_seqs),
            max_num_seqs=args.max_num_seqs,
            max_model_len=n + 1,
            block_size=args.block_size,
            kv_store_dir=str(store_dir),
            **({"cpu_threads": args.threads} if args.threads else {}),
        )
        rng = random.Random(0)
        prompts = [[rng.randrange(2, vocab) for _ in range(n)] for _ in range(args.repeats + 1)]
        warm = [rng.randrange(2, vocab) for _ in range(256)]
        res = Results()
        a, _ = build_engine(EngineConfig(**common))
        print(
            f"model: {desc} | {machine()} | forward threads "
            f"{getattr(a.runner, 'cpu_threads', 0) or torch.get_num_threads()} | prompt {n} "
            f"tokens | device pool {a.kv.num_blocks} blocks = {a.kv.capacity_tokens()} tokens "
            f"| chunk {EngineConfig().max_num_batched_tokens} tokens | store {store_dir}"
        )
        total = 3 * args.repeats + 1 + args.repeats
        with tqdm(total=total, desc="requests", leave=False) as bar:
            await a.start()
            try:
                for _ in range(2):  # first-call paths: a miss, a device hit
                    await first_token(a, warm)
                for r, prompt in enumerate(prompts):
                    res.samples["miss"].append(await first_token(a, prompt))
                    bar.update()
                    if r < args.repeats:
                        res.samples["device"].append(await first_token(a, prompt))
                        bar.update()
                    if r > 0:  # this round's miss pushed the previous prompt to host memory
                        res.samples["host"].append(await first_token(a, prompts[r - 1]))
                        bar.update()
                    # blocks are freed tail first, so the last request's head block outlives
                    # the next miss: make that the short prompt's, not a measured prompt's
                    await first_token(a, warm)
            finally:
                await a.stop()  # waits for the store writes
            b, _ = build_engine(EngineConfig(**common, host_cache_memory_gb=0))
            load_chain = b.scheduler.prefix.store.load_chain

            async def timed_load(keys: list[bytes]) -> list[torch.Tensor]:
                t = time.perf_counter()
                got = await load_chain(keys)
                res.store_reads.append(time.perf_counter() - t)
                res.store_bytes = sum(x.numel() for x in got)
                return got

            b.scheduler.prefix.store.load_chain = timed_load
            await b.start()
            try:
                await first_token(b, warm[:128] + [3] * 128)  # warm-up: a miss (no cache drop)
                res.store_reads.clear()
                for prompt in prompts[: args.repeats]:
                    store = b.scheduler.prefix.store
                    res.cache_drop.add(drop_page_cache(lambda s=store: list(s.dir.rglob("*.kvb"))))
                    res.samples["store"].append(await first_token(b, prompt))
                    bar.update()
            finally:
                await b.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)
    return res


def report(res: Results, args: argparse.Namespace) -> None:
    n = args.prompt_len
    ttft = {k: median([s.ttft for s in v]) for k, v in res.samples.items()}
    print(f"\nstore reads: page cache dropped by {', '.join(sorted(res.cache_drop))}")
    print(
        f"TTFT of a {n}-token prompt, 1 output token; medians ({args.repeats} repeats, miss "
        f"{len(res.samples['miss'])})\n"
    )
    print(
        f"{'':<7} {'TTFT s':>9} {'prompt tok/s':>13} {'miss / this':>12}  "
        f"{'per repeat, s':<28} cached tokens by tier"
    )
    for kind in KINDS:
        samples = res.samples[kind]
        each = " ".join(f"{s.ttft:.3f}" for s in samples)
        tiers = sorted({tuple(sorted(s.tiers.items())) for s in samples})
        tiers_text = "; ".join(", ".join(f"{t} {c}" for t, c in x) or "none" for x in tiers)
        print(
            f"{kind:<7} {ttft[kind]:>9.3f} {n / ttft[kind]:>13,.0f} "
            f"{ttft['miss'] / ttft[kind]:>11.1f}x  {each:<28} {tiers_text}"
        )
    reads = median(res.store_reads)
    print(
        f"store hit: load_chain {reads:.3f} s for {res.store_bytes / 2**20:.1f} MiB "
        f"({res.store_bytes / reads / 1e6:,.0f} MB/s) of its {ttft['store']:.3f} s"
    )
    wrong = [k for k in KINDS[1:] if any(set(s.tiers) != {k} for s in res.samples[k])]
    if wrong:
        print(f"WARNING: hits not (only) from the intended tier: {', '.join(wrong)}")
    print("target: a full hit >= 25x faster than the miss")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3, help="hits per tier (misses: one more)")
    p.add_argument(
        "--store-dir", help="make the block store in a new dir under DIR (default: a temp dir)"
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block (dense models)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="engine cpu_threads (0: its default)")
    p.add_argument("--v4", action="store_true", help="a random DeepSeek-V4 (bench.v4_replay's)")
    args = p.parse_args()
    report(asyncio.run(bench(args)), args)


if __name__ == "__main__":
    main()
