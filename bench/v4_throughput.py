"""Greedy decode throughput on a small random DeepSeek-V4: our engine vs transformers' `generate`,
at 1 and at N concurrent requests (same prompts, same number of output tokens).

    python -m bench.v4_throughput [--concurrency 1 32 --prompt-len 256 --output-len 64 --repeats 3
                                   --dtype float32]

Prompts within a run all have the same length, so transformers gets an unpadded batch (its
reference compressors ignore padding). Each repeat draws fresh prompts, so no prefix-cache hits.
transformers runs with as many torch threads as the engine's forward (--threads to change it):
on a shared machine a 2-thread OpenMP team slows down far more than one thread when a core is
taken by someone else.
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
from bench.step_profile import StepOpProfile, decode_at, report, write_json
from bench.v4_common import (
    DeviceProfile,
    engine_threads,
    forward_threads,
    is_decode_step,
    run_flops,
)
from daemon.models.deepseek_v4.config import V4Config
from daemon.models.loader import read_config

# Small but with every V4 mechanism live: CSA (rate 4, indexer top-k below the entry count)
# and HCA (rate 128) layers, a 128-token window, hash and routed MoE, 4 hyper-connection streams.
V4_BENCH = dict(
    vocab_size=32000,
    hidden_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    head_dim=128,
    q_lora_rank=128,
    o_groups=4,
    o_lora_rank=64,
    n_routed_experts=16,
    num_experts_per_tok=2,
    layer_types=None,  # transformers' default: 2 HCA, then CSA/HCA interleaved
    mlp_layer_types=None,  # 3 hash_moe, then moe
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=128,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=32,
    hc_mult=4,
    partial_rotary_factor=0.25,
    max_position_embeddings=4096,
)


def make_bench_checkpoint(root: Path, weight_scale: float = 0.05, **overrides: Any) -> Path:
    from daemon.models.checkpoints import make_v4_checkpoint

    return make_v4_checkpoint(root, weight_scale=weight_scale, **(V4_BENCH | overrides))


def describe(cfg: dict[str, Any], dtype: str = "float32") -> str:
    return (
        f"V4 {cfg['num_hidden_layers']}L hidden {cfg['hidden_size']} heads "
        f"{cfg['num_attention_heads']}x{cfg['head_dim']} experts {cfg['n_routed_experts']} "
        f"top-{cfg['num_experts_per_tok']} ffn {cfg['moe_intermediate_size']} "
        f"window {cfg['sliding_window']} rates 4/128 index {cfg['index_n_heads']}x"
        f"{cfg['index_head_dim']} top-{cfg['index_topk']} hc {cfg['hc_mult']} "
        f"vocab {cfg['vocab_size']} {dtype}"
    )


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


# ---- the two systems --------------------------------------------------------------------------


@dataclass
class Run:
    outputs: list[list[int]]
    seconds: float  # submit to the last token
    prefill: float  # submit to the moment every request has its first token
    decode_step: float  # then seconds per further token (all requests decoding)


async def run_ours(engine: Any, batch: list[list[int]], max_tokens: int) -> Run:
    """All requests submitted at once."""
    from daemon.loop.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    firsts: list[float] = []

    async def one(prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, params):
            if out.new_token_ids and not tokens:
                firsts.append(time.perf_counter())
            tokens += out.new_token_ids
            if out.num_cached_tokens:
                raise RuntimeError("a prefix-cache hit: prompts must be fresh per run")
        return tokens

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in batch))
    end = time.perf_counter()
    for o in outs:
        if len(o) != max_tokens:
            raise RuntimeError(f"asked for {max_tokens} tokens, got {len(o)}")
    prefill = max(firsts) - t0
    return Run(list(outs), end - t0, prefill, (end - t0 - prefill) / max(max_tokens - 1, 1))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type != "cpu":
        torch.get_device_module(device).synchronize()


def run_hf(model: Any, batch: list[list[int]], max_tokens: int) -> Run:
    """One `generate` call on the whole (unpadded) batch; a streamer notes the first token."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls, self.first = 0, 0.0

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls == 2:  # the first call carries the prompt
                synchronize(value.device)
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    ids = torch.tensor(batch, dtype=torch.long, device=model.device)
    streamer = FirstToken()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    synchronize(ids.device)
    end = time.perf_counter()
    prefill = streamer.first - t0
    decode = (end - t0 - prefill) / max(max_tokens - 1, 1)
    return Run(out[:, ids.shape[1] :].tolist(), end - t0, prefill, decode)


@dataclass
class Series:
    """Per repeat: (ours, transformers) runs at one concurrency."""

    ours: list[Run] = field(default_factory=list)
    hf: list[Run] = field(default_factory=list)

    def tok_s(self, runs: list[Run]) -> float:
        return median([len(r.outputs) * len(r.outputs[0]) / r.seconds for r in runs])

    def ratio(self, attr: str) -> float:
        """Median over repeats of transformers' time / ours (>1: ours faster)."""
        return median([getattr(h, attr) / getattr(o, attr) for o, h in zip(self.ours, self.hf)])

    def agree(self) -> float:
        pairs = [
            (x, y)
            for o, h in zip(self.ours, self.hf)
            for ro, rh in zip(o.outputs, h.outputs)
            for x, y in zip(ro, rh)
        ]
        return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def work_floor(cfg: V4Config, series: dict[int, Series], args: argparse.Namespace) -> str:
    """The run's FLOPs at this machine's matmul peak in the run's dtype: the least time any
    implementation needs here, and so the most any can gain over transformers' measured time."""
    from bench.mfu import matmul_gflops

    dtype = getattr(torch, args.dtype)
    peak = max(matmul_gflops(2048, 2048, 2048, 3, dtype) for _ in range(5))  # the best rate seen
    lines = [
        f"work floor: {args.dtype} matmul peak {peak:.1f} GFLOP/s "
        f"({torch.get_num_threads()} threads, 2048^3, best of 5; the model's own shapes run "
        "slower)"
    ]
    for c, s in series.items():
        flops = run_flops(cfg, c, args.prompt_len, args.output_len)
        floor = flops / (peak * 1e9)
        hf = median([r.seconds for r in s.hf])
        lines.append(
            f"{c:>10} concurrent: {flops / 1e9:.1f} GFLOP -> >= {floor:.2f} s at the peak; "
            f"transformers {hf:.2f} s: no implementation gets past {hf / floor:.1f}x here"
        )
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    quiet_logs()
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="deepinfer-v4-bench-"))
    graphs = "eager" if args.enforce_eager or args.device != "cuda" else "CUDA graphs"
    print("model:", describe(V4_BENCH, args.dtype), "|", machine(), "| device", args.device, graphs)
    path = make_bench_checkpoint(root)
    top = max(args.concurrency)
    engine, _ = build_engine(
        EngineConfig(
            model=str(path),
            device=args.device,
            kv_cache_memory_gb=args.kv_gb,
            max_num_seqs=max(top, 2),
            max_num_batched_tokens=max(args.max_batched_tokens, args.prompt_len),
            enforce_eager=args.enforce_eager,
            dtype=args.dtype,
            **engine_threads(args),
        ),
    )
    # transformers gets as many torch threads as our forward unless told (--threads)
    torch.set_num_threads(args.threads or forward_threads(engine))
    print(
        f"engine forward threads {forward_threads(engine)}, transformers {torch.get_num_threads()}"
    )
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    vocab = V4_BENCH["vocab_size"]
    await engine.start()
    seed = iter(range(1_000_000))
    try:
        # warm-up: allocator, thread pools, first-call paths
        warm = prompts(2, args.prompt_len, vocab, next(seed))
        await run_ours(engine, warm, 4)
        run_hf(hf, warm, 4)

        series = {c: Series() for c in args.concurrency}
        with tqdm(total=len(series) * args.repeats, desc="runs", leave=False) as bar:
            for _ in range(args.repeats):
                for c, s in series.items():
                    batch = prompts(c, args.prompt_len, vocab, next(seed))
                    s.ours.append(await run_ours(engine, batch, args.output_len))
                    s.hf.append(run_hf(hf, batch, args.output_len))
                    bar.update()

        print(
            f"\nprompt {args.prompt_len} tokens (equal lengths, no padding), {args.output_len} "
            f"output tokens each, greedy; medians over {args.repeats} repeats\n"
            "tok/s = output tokens / wall time from submit to the last token; prefill = until every "
            "request has its first token; decode = ms per further step (all requests decoding); "
            "ours/HF = median over repeats of each repeat's time ratio (>1: ours faster)"
        )
        print(
            f"{'concurrent':>10} {'ours tok/s':>11} {'HF tok/s':>9} {'ours/HF':>8} "
            f"{'prefill ours':>13} {'HF':>7} {'decode ours':>12} {'HF':>9} {'ours/HF':>8} "
            f"{'agree':>6}"
        )
        for c, s in series.items():
            pre_o, pre_h = (median([r.prefill for r in rs]) for rs in (s.ours, s.hf))
            dec_o, dec_h = (1e3 * median([r.decode_step for r in rs]) for rs in (s.ours, s.hf))
            print(
                f"{c:>10} {s.tok_s(s.ours):>11.1f} {s.tok_s(s.hf):>9.1f} "
                f"{s.ratio('seconds'):>7.2f}x {pre_o:>11.2f} s {pre_h:>5.2f} s "
                f"{dec_o:>9.1f} ms {dec_h:>6.1f} ms {s.ratio('decode_step'):>7.2f}x "
                f"{s.agree():>6.0%}"
            )
        print("agree = greedy tokens equal to transformers' (float noise can flip near-ties)")

        if args.profile:
            ops = StepOpProfile(engine, decode_at(top), steps=args.profile_steps)
            with ops:
                await run_ours(
                    engine, prompts(top, args.prompt_len, vocab, next(seed)), args.output_len
                )
            title = f"our engine, decode steps at {top} concurrent ({args.dtype})"
            summary = ops.summary()
            print()
            print(report(title, summary))
            context = {
                "bench": "v4_throughput",
                "model": describe(V4_BENCH, args.dtype),
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "device": args.device,
                "machine": machine(),
            }
            write_json(args.profile_json, title, summary, **context)
        if args.cprofile:
            batch = prompts(top, args.prompt_len, vocab, next(seed))
            with (
                DeviceProfile(engine, is_decode_step) as dec,
                DeviceProfile(engine, lambda st: not is_decode_step(st)) as pre,
            ):
                await run_ours(engine, batch, args.output_len)
            print()
            print(pre.report(f"our engine, prefill steps at {top} concurrent", args.profile_top))
            print(dec.report(f"our engine, decode steps at {top} concurrent", args.profile_top))
    finally:
        await engine.stop()
    if args.device == "cpu":  # with the engine stopped: its threads are idle
        print(work_floor(V4Config.from_hf(read_config(path)), series, args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu | cuda | npu (both systems)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="both systems' (bfloat16: V4's serving dtype; greedy agreement then drops to chance "
        "on random weights, whose top logits are near-ties)",
    )
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for transformers (0 = as many as the engine's forward uses)",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=0,
        help="EngineConfig.cpu_threads, the engine's forward threads (0 = the engine's choice)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs for our decode steps (they are on by default on cuda)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="then time one run of ours at the top concurrency by op class (torch.profiler)",
    )
    p.add_argument("--profile-steps", type=int, default=10, help="decode steps profiled")
    p.add_argument(
        "--profile-json",
        type=Path,
        default=Path(__file__).parent / "results" / "step-profiles" / "v4_throughput.json",
        help="where the op-class profile goes",
    )
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="then cProfile one run of ours at the top concurrency",
    )
    p.add_argument(
        "--profile-top",
        type=int,
        default=0,
        help="with --cprofile: also the N top functions by self time",
    )
    args = p.parse_args()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
