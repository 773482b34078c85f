"""Issue 23 in the simulator (daemon/sim/pd.py, run by the router's own policy code): the
traffic shift of bench/autoscale.py, and a Mooncake trace scaled up, each with fixed roles and
autoscaled: SLO attainment (overall and by phase / by minute), node-seconds by role, the moves.

    python -m bench.autoscale_sim [--trace T --table daemon/sim/tables/seed-card.json
        --duration-s 600 --time-scale 0.5 --prefill 4 --decode 4 --json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time
from pathlib import Path

from daemon.cluster.autoscale import Targets
from daemon.sim.node import NodeConfig
from daemon.sim.pd import PDConfig, PDRun, simulate_pd, summarize_pd
from daemon.sim.table import CostTable
from daemon.sim.trace import TRACE_BLOCK, TraceRequest, read_trace

GB = 2**30
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
SEED_TABLE = Path(__file__).resolve().parents[1] / "daemon" / "sim" / "tables" / "seed-card.json"


def attainment(run: PDRun, t: Targets, bucket_s: float) -> list[float]:
    """SLO attainment of the requests arriving in each `bucket_s` of the run."""
    met: dict[int, list[bool]] = {}
    for r in run.records:
        ok = r.finish_s is not None and r.first_token_s is not None
        if ok and r.first_token_s - r.arrival_s > t.ttft_p99_s:  # type: ignore[operator]
            ok = False
        if ok and r.output_length > 1:
            tpot = (r.finish_s - r.first_token_s) / (r.output_length - 1)  # type: ignore[operator]
            ok = tpot <= t.tpot_p99_s
        met.setdefault(int(r.arrival_s // bucket_s), []).append(ok)
    return [sum(v) / len(v) for _, v in sorted(met.items())]


def compare(
    table: CostTable, trace: list[TraceRequest], cfg: PDConfig, t: Targets, bucket_s: float
) -> list[dict]:
    """Fixed roles, then the same cluster autoscaled."""
    out = []
    for scaled in (False, True):
        c = dataclasses.replace(cfg, targets=t if scaled else None)
        start = time.monotonic()
        run = simulate_pd(table, trace, c)
        r = summarize_pd(run, t)
        r["wall_s"] = round(time.monotonic() - start, 1)
        r["attainment_by_bucket"] = attainment(run, t, bucket_s)
        r["bucket_s"] = bucket_s
        out.append(r)
        print(
            f"sim {'autoscale' if scaled else 'fixed'}: {r['finished']} requests, SLO attainment "
            f"{100 * r['slo']['attainment']:.1f} % "
            f"[{' | '.join(f'{100 * a:.0f}' for a in r['attainment_by_bucket'])}], TTFT p99 "
            f"{r['ttft_s']['p99']:.2f} s, TPOT p99 {r['tpot_s']['p99']:.3f} s, node-seconds "
            + ", ".join(f"{k} {v:.0f}" for k, v in r["node_seconds"].items())
            + f", moves {[(m['node'], m['role'], round(m['switched_s'])) for m in r['moves']]}"
            f" ({r['wall_s']} s wall)"
        )
    return out


def shift(args: argparse.Namespace, table_path: Path) -> list[dict]:
    """bench/autoscale.py's shift through 2 + 2 simulated nodes like its daemons."""
    from bench.autoscale import phases

    ids = itertools.count()
    trace = []
    for k, (rate, prompt, out) in enumerate(phases(args)):
        for i in range(int(args.phase_s * rate)):
            blocks = tuple(next(ids) for _ in range(-(-prompt // TRACE_BLOCK)))  # no prefix hits
            trace.append(TraceRequest(k * args.phase_s + i / rate, prompt, out, blocks))
    t = Targets(
        ttft_p99_s=args.ttft_s, tpot_p99_s=args.tpot_s, node_dwell_s=args.node_dwell_s,
        global_dwell_s=args.global_dwell_s, queue_per_node=args.queue_per_node,
    )  # fmt: skip
    node = NodeConfig(args.kv_gb * GB, 0, args.max_num_seqs, args.max_num_batched_tokens)
    cfg = PDConfig(
        2, 2, node, window_s=args.window_s, handoff_min_tokens=args.handoff_min_tokens,
        request_s=args.sim_request_ms / 1000,
        request_s_per_token=args.sim_request_ms_per_token / 1000,
        stream_s_per_token=args.sim_stream_ms_per_token / 1000,
    )  # fmt: skip
    return compare(CostTable.load(table_path), trace, cfg, t, args.phase_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--table", type=Path, default=SEED_TABLE)
    p.add_argument("--duration-s", type=float, default=600, help="the trace's first seconds")
    p.add_argument("--time-scale", type=float, default=0.5, help="0.5: arrivals twice as dense")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--device-kv-gb", type=float, default=40)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--ttft-s", type=float, default=2.0)
    p.add_argument("--tpot-s", type=float, default=0.05)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--node-dwell-s", type=float, default=60.0)
    p.add_argument("--global-dwell-s", type=float, default=20.0)
    p.add_argument("--bucket-s", type=float, default=60.0, help="attainment by this much time")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    trace = read_trace(args.trace, until_s=args.duration_s)
    node = NodeConfig(args.device_kv_gb * GB, 0, args.max_num_seqs, args.max_num_batched_tokens)
    cfg = PDConfig(
        args.prefill, args.decode, node, window_s=args.window_s, time_scale=args.time_scale
    )
    t = Targets(
        ttft_p99_s=args.ttft_s, tpot_p99_s=args.tpot_s, node_dwell_s=args.node_dwell_s,
        global_dwell_s=args.global_dwell_s,
    )  # fmt: skip
    print(
        f"{len(trace)} requests of {args.trace.name} ({args.duration_s:.0f} s) at time scale "
        f"{args.time_scale} on {args.prefill} + {args.decode} nodes ({args.table.name})"
    )
    runs = compare(CostTable.load(args.table), trace, cfg, t, args.bucket_s * args.time_scale)
    if args.json:
        out = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
        args.json.write_text(json.dumps(out, indent=2, default=_jsonable))


def _jsonable(x: object) -> object:
    return None if isinstance(x, float) and math.isnan(x) else str(x)


if __name__ == "__main__":
    main()
