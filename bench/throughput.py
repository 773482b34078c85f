"""Offline throughput on one random-weight checkpoint and one seeded workload:
our engine (overlap on) vs transformers' continuous batching vs static-batch `generate`.

    python -m bench.throughput [--requests 64 --prompt-len 32-256 --output-len 32-128 --repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import (
    ModelSpec,
    Request,
    RequestTiming,
    build_ours,
    describe_steps,
    machine,
    make_checkpoint,
    make_workload,
    median,
    parse_range,
    percentile,
    profile_steps,
    quiet_logs,
    run_ours,
)
from bench.step_profile import StepOpProfile, decode_at, report, write_json

RESULTS = Path(__file__).parent / "results"


@dataclass
class SystemRuns:
    name: str
    tok_s: list[float] = field(default_factory=list)
    elapsed: list[float] = field(default_factory=list)
    timings: list[RequestTiming] = field(default_factory=list)

    def add(self, elapsed: float, tokens: int, timings: list[RequestTiming]) -> None:
        self.tok_s.append(tokens / elapsed)
        self.elapsed.append(elapsed)
        self.timings.extend(timings)

    def latency(self) -> str:
        ttft = [t.ttft for t in self.timings if t.token_times]
        tpot = [x for t in self.timings if (x := t.tpot) is not None]
        return (
            f"TTFT p50 {percentile(ttft, 50):.2f} s, p99 {percentile(ttft, 99):.2f} s; "
            f"TPOT p50 {1e3 * percentile(tpot, 50):.0f} ms, p99 {1e3 * percentile(tpot, 99):.0f} ms"
        )


# ---- transformers -----------------------------------------------------------------------------


def load_hf(path: Path, attn: str, dtype: str = "float32") -> Any:
    """transformers in our dtype (auto: the checkpoints here are float32)."""
    from transformers import LlamaForCausalLM

    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return LlamaForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=torch_dtype
    ).eval()


def cb_config(args: argparse.Namespace, capacity_tokens: int) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Same KV capacity, token budget and batch cap as our engine; no flash on CPU.
    return ContinuousBatchingConfig(
        num_blocks=math.ceil(capacity_tokens / args.hf_page_size),
        page_size=args.hf_page_size,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        allow_block_sharing=False,
        auto_switch_to_flash=False,
    )


def run_hf_cb(
    model: Any, workload: list[Request], cfg: Any, uniform: bool
) -> tuple[float, int, list[RequestTiming]]:
    """transformers continuous batching. Uniform lengths: `generate_batch` itself (its timing then
    includes its cache setup, ~0.2 s). Mixed lengths: the manager `generate_batch` wraps, with
    `add_request(max_new_tokens=...)` per request (generate_batch takes one length for all)."""
    from transformers import GenerationConfig

    longest = max(r.max_tokens for r in workload)
    gen = GenerationConfig(
        max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    inputs = [r.prompt for r in workload]
    if uniform:
        t0 = time.perf_counter()
        out = model.generate_batch(
            inputs=inputs,
            generation_config=gen,
            continuous_batching_config=cfg,
            record_timestamps=True,
            progress_bar=True,
        )
        elapsed = time.perf_counter() - t0
        results = list(out.values())
    else:
        with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cfg, block=True, timeout=5
        ) as manager:
            t0 = time.perf_counter()
            ids = [
                manager.add_request(
                    input_ids=r.prompt, max_new_tokens=r.max_tokens, record_timestamps=True
                )
                for r in workload
            ]
            done: dict[str, Any] = {}
            with tqdm(total=len(ids), desc="transformers CB", unit="req", leave=False) as bar:
                while len(done) < len(ids):
                    res = manager.get_result(timeout=1)
                    if res is not None and res.is_finished():
                        done[res.request_id] = res
                        bar.update(1)
                    elif res is None and not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread died")
            elapsed = time.perf_counter() - t0
        results = [done[i] for i in ids]
    counts = [len(r.generated_tokens) for r in results]
    for req, res, n in zip(workload, results, counts):
        if res.error is not None or n != req.max_tokens:
            raise RuntimeError(
                f"transformers CB: asked for {req.max_tokens} tokens, got {n} ({res.error})"
            )
    timings = [RequestTiming(t0, list(r.timestamps or [])) for r in results]
    return elapsed, sum(counts), timings


@torch.inference_mode()
def run_static(model: Any, workload: list[Request], chunk: int) -> tuple[float, int]:
    """Static batches of `chunk` requests in submission order, left-padded; each batch runs to its
    longest output. Only the tokens each request asked for count as output."""
    t0 = time.perf_counter()
    useful = 0
    for i in tqdm(
        range(0, len(workload), chunk), desc="static generate", unit="batch", leave=False
    ):
        part = workload[i : i + chunk]
        width = max(len(r.prompt) for r in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for row, r in enumerate(part):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        longest = max(r.max_tokens for r in part)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        if out.shape[1] - width != longest:
            raise RuntimeError(
                f"static generate: asked for {longest} tokens, got {out.shape[1] - width}"
            )
        useful += sum(r.max_tokens for r in part)
    return time.perf_counter() - t0, useful


# ---- main -------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace) -> None:
    spec = ModelSpec(
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab
    )
    path = make_checkpoint(spec, seed=args.seed)
    workload = make_workload(
        args.requests,
        parse_range(args.prompt_len),
        parse_range(args.output_len),
        spec.vocab,
        args.seed,
    )
    if args.uniform_output:
        workload = [Request(r.prompt, args.uniform_output) for r in workload]
    uniform = len({r.max_tokens for r in workload}) == 1
    prompt_tokens = sum(len(r.prompt) for r in workload)
    output_tokens = sum(r.max_tokens for r in workload)
    print(f"model: {spec.describe(args.dtype)}  [{path}]")
    print(
        f"workload: {len(workload)} requests, {prompt_tokens} prompt tokens, {output_tokens} output "
        f"tokens (prompt {args.prompt_len}, output "
        f"{args.uniform_output if uniform and args.uniform_output else args.output_len}), "
        f"seed {args.seed}, all submitted at t=0; {machine()}"
    )

    engine = build_ours(
        path,
        True,
        args.kv_cache_gb,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        dtype=args.dtype,
    )
    await engine.start()
    systems = {"ours": SystemRuns("ours (overlap on)")}
    hf_cb = hf_static = None
    if not args.skip_cb:
        hf_cb = load_hf(path, args.hf_attn, args.dtype)
        cfg = cb_config(args, engine.kv.capacity_tokens())
        systems["cb"] = SystemRuns(f"transformers CB ({args.hf_attn})")
    if not args.skip_static:
        hf_static = load_hf(path, "sdpa", args.dtype)
        systems["static"] = SystemRuns(f"static generate (sdpa, chunks of {args.static_chunk})")

    # Warm-up (allocators, first-call paths) on a few short requests; not timed.
    warm = make_workload(4, (16, 32), (4, 4), spec.vocab, args.seed + 1)
    await run_ours(engine, warm)
    if hf_cb is not None:
        run_hf_cb(hf_cb, warm, cfg, uniform=True)
    if hf_static is not None:
        run_static(hf_static, warm, args.static_chunk)

    prof = profile_steps(engine) if args.profile else None
    ops = StepOpProfile(engine, decode_at(), steps=args.profile_steps)
    for rep in range(args.repeats):
        run = await run_ours(engine, workload, desc=f"ours #{rep + 1}")
        systems["ours"].add(run.elapsed, run.output_tokens, run.timings)
        line = f"repeat {rep + 1}: ours {run.tok_s:7.1f} tok/s ({run.elapsed:.1f} s)"
        if hf_cb is not None:
            elapsed, n, timings = run_hf_cb(hf_cb, workload, cfg, uniform)
            systems["cb"].add(elapsed, n, timings)
            line += f" | transformers CB {n / elapsed:7.1f} tok/s ({elapsed:.1f} s)"
        if hf_static is not None:
            elapsed, n = run_static(hf_static, workload, args.static_chunk)
            systems["static"].add(elapsed, n, [])
            line += f" | static {n / elapsed:7.1f} tok/s ({elapsed:.1f} s)"
        print(line, flush=True)
    if prof is not None:  # a run of its own: the profiler slows the steps it watches
        with ops:
            await run_ours(engine, workload, desc="ours, profiled")
    await engine.stop()

    print(f"\nmedians over {args.repeats} repeat(s), output tokens per second:")
    for s in systems.values():
        print(f"  {s.name:42s} {median(s.tok_s):8.1f} tok/s   ({median(s.elapsed):.1f} s)")
    ours = median(systems["ours"].tok_s)
    for key, label in (("cb", "ours / transformers CB"), ("static", "ours / static generate")):
        if key in systems:
            print(f"  {label:42s} {ours / median(systems[key].tok_s):8.2f}x")
    print("latency per request, all submitted at t=0 (all repeats):")
    for key in ("ours", "cb"):
        if key in systems:
            print(f"  {systems[key].name:42s} {systems[key].latency()}")
    if prof is not None:
        print("ours, per engine step (median):")
        for label, decode_only in (("decode-only steps", True), ("steps with prefill", False)):
            print(f"  {label}: {describe_steps(prof.summary(decode_only))}")
        title = f"ours, decode-only steps ({args.dtype})"
        summary = ops.summary()
        print(report(title, summary))
        context = {"bench": "throughput", "model": spec.describe(args.dtype), "machine": machine()}
        write_json(args.profile_json, title, summary, **context)
    if not args.no_plot:
        plot(systems, args)


def plot(systems: dict[str, SystemRuns], args: argparse.Namespace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; no plot")
        return
    RESULTS.mkdir(exist_ok=True)
    names = [s.name.split(" (")[0] for s in systems.values()]
    values = [median(s.tok_s) for s in systems.values()]
    fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
    bars = ax.bar(names, values, color=["tab:green", "tab:blue", "tab:gray"][: len(values)])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tok/s (median)")
    ax.set_title(f"{args.requests} requests, {os.cpu_count()}-core CPU", fontsize=10)
    fig.tight_layout()
    out = RESULTS / "throughput.png"
    fig.savefig(out)
    print(f"plot: {out}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", default="32-512", help="inclusive range, e.g. 32-256")
    p.add_argument("--output-len", default="32-256", help="inclusive range, e.g. 32-128")
    p.add_argument(
        "--uniform-output",
        type=int,
        default=0,
        help="give every request this output length (then transformers runs generate_batch)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-attn", default="sdpa", choices=["paged|eager", "sdpa"])
    p.add_argument("--hf-page-size", type=int, default=256)
    p.add_argument("--static-chunk", type=int, default=16)
    p.add_argument("--skip-cb", action="store_true")
    p.add_argument("--skip-static", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--profile",
        action="store_true",
        help="time schedule/prepare/execute per step, and decode steps by op class",
    )
    p.add_argument("--profile-steps", type=int, default=10, help="decode steps profiled")
    p.add_argument(
        "--profile-json",
        type=Path,
        default=RESULTS / "step-profiles" / "throughput.json",
        help="where the op-class profile goes",
    )
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_logs()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
