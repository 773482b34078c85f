"""What a draft row really costs: steps of N decoding sequences, some verifying L drafts each,
timed as the engine times a step (ModelRunner.prepare + execute; alternating, medians), against
the startup profile's step-cost table and the online fit (`MeasuredCost`) fed those steps; and
what a sequence sitting a step out saves (under overlap a verifying sequence sits out the next):
decode steps of N - S sequences against N.

    python -m bench.spec_cost --model DIR [--dtype bfloat16 --seqs 32 --context 128 384
                                           --verify 8x1 32x1 8x5 16x5 32x5 --sit-out 4 8 16
                                           --repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from bench.common import machine, quiet_logs
from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.kv.manager import KVManager
from daemon.kv.tier_ops import CacheOps
from daemon.loop.engine import Engine
from daemon.loop.request import Request, SamplingParams
from daemon.loop.scheduler import ScheduledSeq, SchedulerStep
from daemon.loop.spec.online_cost import MeasuredCost


@contextmanager
def verify_step(
    kv: KVManager, vocab: int, seqs: int, context: int, verifying: int, drafts: int
) -> Iterator[SchedulerStep]:
    """`seqs` sequences one token past `context` positions, the first `verifying` of them with
    `drafts` draft rows after it (tokens the model will not predict: all rejected, as the
    profile's); their blocks taken from `kv` and given back after."""
    reqs: list[Request] = []
    out: list[ScheduledSeq] = []
    try:
        for i in range(seqs):
            n = drafts + 1 if i < verifying else 1
            req = Request(f"spec-cost-{i}", [], SamplingParams(max_tokens=1 << 20))
            req.prompt_ids = [(31 * p + 7 * i) % vocab for p in range(context + n)]
            req.slot = i
            reqs.append(req)
            if not kv.grow(req.request_id, context + n):
                raise SystemExit("the KV pool is too small: raise --kv-gb")
            out.append(ScheduledSeq(req, context, n, True, 0, draft=req.prompt_ids[context + 1 :]))
        out.sort(key=lambda s: s.order)
        yield SchedulerStep(out)
    finally:
        for req in reqs:
            kv.free(req.request_id)


def run_once(engine: Engine, point: tuple[int, int, int], seqs: int, context: int) -> float:
    """One step of `point` = (verifying, drafts, sitting out) over `seqs` sequences."""
    runner = engine.runner
    verifying, drafts, out = point
    with verify_step(engine.kv, runner.vocab_size, seqs - out, context, verifying, drafts) as step:
        t0 = time.perf_counter()
        runner.execute(runner.prepare(step, engine.kv, CacheOps()))
        return time.perf_counter() - t0


def fit_marginal(extra: dict[tuple[int, int], float]) -> tuple[float, float]:
    """(seconds per verifying sequence, seconds per draft row): least squares of each point's
    seconds over the decode step against both, through the origin."""
    svv = sum(v * v for v, _ in extra)
    svd = sum(v * v * d for v, d in extra)
    sdd = sum((v * d) ** 2 for v, d in extra)
    sy_v = sum(v * y for (v, _), y in extra.items())
    sy_d = sum(v * d * y for (v, d), y in extra.items())
    det = svv * sdd - svd * svd
    if abs(det) < 1e-12:  # one draft length only: all of it per row
        return 0.0, sy_d / sdd
    return (sy_v * sdd - sy_d * svd) / det, (svv * sy_d - svd * sy_v) / det


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--context", type=int, nargs="+", default=[128, 384])
    p.add_argument("--verify", nargs="+", default=["8x1", "32x1", "8x5", "16x5", "32x5"])
    p.add_argument("--sit-out", type=int, nargs="*", default=[4, 8, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--kv-gb", type=float, default=0.75)
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args()
    quiet_logs()
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory_gb=args.kv_gb,
        kv_store_dir=None,
        max_num_seqs=args.max_num_seqs,
        speculative="ngram",
        spec_policy="adaptive",  # profiles the step-cost table at start
    )
    engine, _ = build_engine(cfg)
    spec = engine.scheduler.speculator
    assert spec is not None
    cost = getattr(spec.policy, "cost", None)
    assert isinstance(cost, MeasuredCost)
    table = cost.table
    n = args.seqs
    verify = [tuple(int(x) for x in v.split("x")) for v in args.verify]
    points = [(0, 0, 0)] + [(v, d, 0) for v, d in verify]
    points += [(0, 0, s) for s in args.sit_out if 0 < s < n]
    print(machine())
    print(f"{args.model} {args.dtype}, {n} sequences, ngram drafts all rejected")
    for context in args.context:
        times: dict[tuple[int, int, int], list[float]] = {pt: [] for pt in points}
        for pt in points:
            run_once(engine, pt, n, context)  # warm-up: first-touched pages, kernel selection
        for _ in tqdm(range(args.repeats), desc=f"context {context}", leave=False):
            for pt in points:  # alternating
                times[pt].append(run_once(engine, pt, n, context))
        med = {pt: statistics.median(ts) for pt, ts in times.items()}
        base = med[(0, 0, 0)]
        extra = {(v, d): med[(v, d, 0)] - base for v, d in verify}
        per_seq, per_row = fit_marginal(extra)
        online = MeasuredCost(table)
        for _ in range(4):  # the online fit fed these steps as they would come
            for (v, d, out), ts in times.items():
                for t in ts:
                    online.observe(n - out + v * d, n - out, v * d, t)
        print(f"\ncontext {context}: {n} decodes {base * 1e3:.1f} ms")
        print("verifying x drafts  step ms  +ms  ms/draft  table ms/draft  online ms/draft")
        for (v, d), x in extra.items():
            rows = v * d
            t_price = (table.seconds(n + rows, n) - table.seconds(n, n)) / rows
            o_price = (online.seconds(n + rows, n, rows) - online.seconds(n, n, 0)) / rows
            print(
                f"{v:9d} x {d:<6d} {med[(v, d, 0)] * 1e3:9.1f} {x * 1e3:5.1f} {x / rows * 1e3:9.2f}"
                f" {t_price * 1e3:15.2f} {o_price * 1e3:16.2f}"
            )
        print(
            f"fit: {per_seq * 1e3:.2f} ms per verifying sequence + {per_row * 1e3:.2f} ms per"
            f" draft row; rollback {table.rollback_seconds * 1e3:.3f} ms per verifying sequence"
        )
        sits = [pt for pt in points if pt[2]]
        if sits:
            print("sitting out  step ms  saved ms  ms/seq  table ms/seq  online ms/seq")
        for pt in sits:
            out, m = pt[2], n - pt[2]
            saved = base - med[pt]
            t_saved = table.seconds(n, n) - table.seconds(m, m)
            o_saved = online.seconds(n, n) - online.seconds(m, m)
            print(
                f"{out:11d} {med[pt] * 1e3:8.1f} {saved * 1e3:9.1f} {saved / out * 1e3:7.2f}"
                f" {t_saved / out * 1e3:13.2f} {o_saved / out * 1e3:14.2f}"
            )


if __name__ == "__main__":
    main()
