"""A step with prefill chunks beside decodes, eager vs the compiled CPU forward: ms per step
(alternating repeats, medians) and the torch ops each dispatches from Python.

    python -m bench.mixed_step --model DIR [--dtype bfloat16 --decodes 0 16 --chunk 64 256
                                            --context 256 --repeats 7]

Both engines are built in one process on the same checkpoint; each step is prepared and run
as the engine's device thread runs it (ModelRunner.prepare / execute), sampling included.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from bench.common import machine, quiet_logs
from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.kv.manager import KVManager
from daemon.kv.tier_ops import CacheOps
from daemon.loop.engine import Engine
from daemon.loop.request import Request, SamplingParams
from daemon.loop.scheduler import ScheduledSeq, SchedulerStep


@contextmanager
def mixed_step(
    kv: KVManager, vocab: int, decodes: int, context: int, chunk: int
) -> Iterator[SchedulerStep]:
    """`decodes` sequences one token past `context` positions, then a fresh prompt's chunk of
    `chunk` tokens; their blocks taken from `kv` and given back after."""
    reqs: list[Request] = []
    seqs: list[ScheduledSeq] = []
    counts = [(context, 1)] * decodes + [(0, chunk)]
    try:
        for i, (start, tokens) in enumerate(counts):
            req = Request(f"mixed-{i}", [], SamplingParams(max_tokens=1 << 20))
            req.prompt_ids = [(31 * p + 7 * i) % vocab for p in range(start + tokens)]
            req.slot = i
            reqs.append(req)
            if not kv.grow(req.request_id, start + tokens):
                raise SystemExit("the KV pool is too small: raise --kv-gb")
            seqs.append(ScheduledSeq(req, start, tokens, True, 0))
        yield SchedulerStep(seqs)
    finally:
        for req in reqs:
            kv.free(req.request_id)


def run_once(engine: Engine, step: SchedulerStep) -> float:
    runner = engine.runner
    t0 = time.perf_counter()
    runner.execute(runner.prepare(step, engine.kv, CacheOps()))
    return time.perf_counter() - t0


def op_count(engine: Engine, step: SchedulerStep) -> int:
    """Torch ops dispatched from Python in one step (the top of each op's call tree)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_once(engine, step)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    ids = {e.id for e in events}
    return sum(1 for e in events if e.cpu_parent is None or e.cpu_parent.id not in ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--decodes", type=int, nargs="+", default=[0, 16])
    p.add_argument("--chunk", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--kv-gb", type=float, default=0.5)
    args = p.parse_args()
    quiet_logs()
    engines = {}
    for name, eager in (("eager", True), ("compiled", False)):
        cfg = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_memory_gb=args.kv_gb,
            enforce_eager=eager,
            kv_store_dir=None,
            max_num_batched_tokens=max(args.chunk) + max(args.decodes),
        )
        engines[name], _ = build_engine(cfg)
    print(machine())
    print(f"{args.model} {args.dtype}, decodes at context {args.context} + one fresh chunk")
    print("decodes  chunk   eager ms  compiled ms  eager/compiled  ops eager  ops compiled")
    points = [(d, c) for d in args.decodes for c in args.chunk]
    for decodes, chunk in tqdm(points, desc="points", leave=False):
        times: dict[str, list[float]] = {name: [] for name in engines}
        ops = {}
        for name, engine in engines.items():
            with mixed_step(engine.kv, engine.runner.vocab_size, decodes, args.context, chunk) as s:
                run_once(engine, s)  # warm-up: first-touched pages, kernel selection
                ops[name] = op_count(engine, s)
        for _ in range(args.repeats):  # alternating
            for name, engine in engines.items():
                vocab = engine.runner.vocab_size
                with mixed_step(engine.kv, vocab, decodes, args.context, chunk) as s:
                    times[name].append(run_once(engine, s))
        e, c = (statistics.median(times[n]) * 1e3 for n in ("eager", "compiled"))
        print(
            f"{decodes:7d} {chunk:6d} {e:10.1f} {c:12.1f} {e / c:14.2f}x"
            f" {ops['eager']:10d} {ops['compiled']:13d}"
        )


if __name__ == "__main__":
    main()
