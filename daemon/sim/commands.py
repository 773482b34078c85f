"""`deepinfer profile` and `deepinfer simulate`: their arguments and what they run."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import structlog

from daemon.build.config import EngineConfig
from daemon.cluster.balance_flags import add_prefill_balance_flags
from daemon.cluster.router import PrefillBalance
from daemon.sim.moe_flags import add_moe_flags, moe_config
from daemon.sim.router import POLICIES
from daemon.sim.spec_flags import add_spec_flags, spec_config
from daemon.sim.table import Bandwidth, CostTable, TableError
from daemon.sim.trace import TraceError, TraceRequest, read_trace

if TYPE_CHECKING:
    from daemon.sim.cluster import ClusterConfig

TABLES = Path(__file__).parent / "tables"
CPU_TABLE = TABLES / "cpu-smollm2.json"
GB = 2**30


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="where to write the cost table (JSON)")
    p.add_argument(
        "--quick", action="store_true", help="a tiny grid (seconds; for tests, not for use)"
    )
    p.add_argument("--note", default="", help="kept in the table's provenance")
    g = p.add_argument_group(
        "grid (default: the full grid; points a workload runs at make its table closer)"
    )
    for flag, help_ in (
        ("--prefill-tokens", "prefill chunk sizes, e.g. 32,256,512,2048"),
        ("--prefill-context", "positions computed before a chunk, e.g. 0,4096"),
        ("--decode-seqs", "decode batch sizes, e.g. 1,8,32"),
        ("--decode-context", "each decode's context, e.g. 256,2048"),
        (
            "--prefill-batch",
            "chunks per step, 1 and more, e.g. 1,8: steps of that many chunks of each "
            "--prefill-tokens size that fits (a step's once-paid part and each chunk's own; "
            "default 1,4)",
        ),
    ):
        g.add_argument(flag, type=_counts, default=None, help=help_)
    g.add_argument(
        "--point-seconds",
        type=float,
        default=None,
        help="a point's first run is an untimed warm-up unless it took this long, and its "
        "repeats stop once they took it (default 2; raise it where steps take seconds)",
    )


def run_profile(args: argparse.Namespace, engine_cfg: EngineConfig) -> int:
    from daemon.build.engine import build_engine
    from daemon.sim.profile import QUICK, ProfileError, ProfileGrid, profile

    grid = QUICK if args.quick else ProfileGrid()
    axes = ("prefill_tokens", "prefill_context", "decode_seqs", "decode_context", "prefill_batch")
    grid = dataclasses.replace(
        grid, **{a: tuple(getattr(args, a)) for a in axes if getattr(args, a) is not None}
    )
    if args.point_seconds is not None:
        grid = dataclasses.replace(grid, point_seconds=args.point_seconds)
    if min(grid.prefill_tokens[0], grid.decode_seqs[0]) < 1:
        print("deepinfer profile: --prefill-tokens and --decode-seqs must be >= 1", file=sys.stderr)
        return 2
    if args.prefill_batch is not None and (
        len(args.prefill_batch) < 2 or args.prefill_batch[0] != 1
    ):
        print("deepinfer profile: --prefill-batch must be 1 and more, e.g. 1,8", file=sys.stderr)
        return 2
    cfg = dataclasses.replace(
        engine_cfg,
        kv_store_dir=None,  # the profile measures a store of its own, in a temporary directory
        speculative=None,
        draft_model=None,
        max_num_seqs=max(engine_cfg.max_num_seqs, max(grid.decode_seqs)),
        max_num_batched_tokens=max(engine_cfg.max_num_batched_tokens, max(grid.prefill_tokens)),
    )
    needed = grid.kv_tokens() * _kv_bytes_per_token(cfg) * 1.05 / GB
    cfg = dataclasses.replace(cfg, kv_cache_memory_gb=max(cfg.kv_cache_memory_gb, needed))
    engine, name = build_engine(cfg)
    try:
        table = profile(engine, name, grid)
    except ProfileError as e:
        print(f"deepinfer profile: {e}", file=sys.stderr)
        return 2
    if args.note:
        table.provenance.note += f"; {args.note}"
    Path(args.out).write_bytes(table.to_json())
    print(f"wrote {args.out}")
    return 0


def _kv_bytes_per_token(cfg: EngineConfig) -> float:
    """At most what a token of the model's KV takes (the grid's KV budget from it): in the
    dtype asked for, fp32 where that is `auto`."""
    from daemon.build.demo import model_path
    from daemon.models.loader import ModelLoadError, read_config

    try:
        hf = read_config(model_path(cfg))
    except (ModelLoadError, OSError):
        return 0.0  # build_engine says what is wrong with the model
    layers, heads = hf.get("num_hidden_layers", 1), hf.get("num_attention_heads", 1)
    head_dim = hf.get("head_dim") or hf.get("hidden_size", 64) // heads
    itemsize = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    return 2 * layers * hf.get("num_key_value_heads", heads) * head_dim * itemsize


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake FAST'25 trace (JSON lines)")
    p.add_argument("--table", default=str(CPU_TABLE), help="cost table (deepinfer profile)")
    p.add_argument(
        "--nodes", type=int, default=None, help="unified nodes (default 1, 0 with pairs)"
    )
    p.add_argument("--prefill", type=int, default=0, help="prefill nodes (with --decode)")
    p.add_argument("--decode", type=int, default=0, help="decode nodes (with --prefill)")
    p.add_argument(
        "--link-gb-s", type=float, default=25.0, help="KV handoff link, GB/s (prefill to decode)"
    )
    p.add_argument("--link-latency-ms", type=float, default=0.1, help="per handoff")
    p.add_argument("--policy", choices=POLICIES, default=POLICIES[0])
    p.add_argument("--device-kv-gb", type=float, default=1.0, help="KV memory per node")
    p.add_argument("--host-cache-gb", type=float, default=4.0, help="host tier per node (0: none)")
    p.add_argument(
        "--store-gb",
        type=float,
        default=0.0,
        help="block store shared by the nodes (0: none; inf: unlimited)",
    )
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--limit", type=int, default=None, help="the trace's first N requests")
    p.add_argument("--duration-s", type=float, default=None, help="requests arriving before")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="arrival times times this (2: half rate)"
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="clients: at most N requests in flight, the next sent as one finishes (0: no bound)",
    )
    p.add_argument(
        "--request-ms",
        type=float,
        default=0.0,
        help="a serving node's HTTP front per request (parsing, codec), one at a time (0: none)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="nodes schedule a step while the last one runs (the engine's overlap)",
    )
    add_prefill_balance_flags(p)
    add_moe_flags(p)
    add_spec_flags(p)
    p.add_argument("--out", required=True, help="result JSON; the plots beside it (.png)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--sweep-host-gb",
        type=_sizes,
        default=None,
        help="hit rate vs capacity: host memory per node to try, e.g. 0,16,64,inf",
    )
    p.add_argument(
        "--sweep-store-gb", type=_sizes, default=None, help="block-store capacities to try"
    )
    p.add_argument(
        "--size",
        action="store_true",
        help="sizing: the cheapest cluster (unified count, or prefill:decode) meeting the SLOs",
    )
    p.add_argument("--ttft-p99-s", type=float, default=2.0, help="sizing: TTFT p99 SLO")
    p.add_argument("--tpot-p99-s", type=float, default=0.05, help="sizing: TPOT p99 SLO")
    p.add_argument("--max-nodes", type=int, default=64, help="sizing: the largest cluster")
    p.add_argument(
        "--size-host-gb", type=_sizes, default=None, help="sizing: host memory per node to try"
    )
    p.add_argument(
        "--host-gb-cost", type=float, default=0.0, help="sizing: a host GB's cost, in nodes"
    )
    p.add_argument("--size-modes", default="unified,pairs", help="sizing: unified, pairs or both")


def run_simulate(args: argparse.Namespace) -> int:
    from daemon.sim.cluster import simulate
    from daemon.sim.result import summarize

    # the scheduler's per-step debug lines (preemptions) would flood the terminal
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    problem = _check(args)
    if problem:
        print(f"deepinfer simulate: {problem}", file=sys.stderr)
        return 2
    try:
        table = CostTable.load(args.table)
        trace = read_trace(args.trace, args.limit, args.duration_s)
    except (OSError, TableError, TraceError) as e:
        print(f"deepinfer simulate: {e}", file=sys.stderr)
        return 2
    cfg = _cluster(args)
    if args.sweep_host_gb or args.sweep_store_gb:
        return _sweep(args, table, trace, cfg)
    if args.size:
        return _size(args, table, trace, cfg)
    run = simulate(table, trace, cfg, progress=not args.no_progress)
    summary = summarize(run) | {"table": dataclasses.asdict(table.provenance), "trace": args.trace}
    out = Path(args.out)
    out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    png = _plot(out, "plot", run, summary)
    t, p = summary["ttft_s"], summary["prefix"]
    print(
        f"{summary['finished']}/{summary['requests']} requests in {run.end_s:.1f} simulated s "
        f"({run.wall_s:.1f} s wall): {summary['throughput']['output_tok_s']:.1f} output tok/s, "
        f"TTFT p50 {t['p50']} s p99 {t['p99']} s, hit rate {100 * p['hit_rate']:.1f} %; "
        f"wrote {out}" + (f" and {png}" if png else "")
    )
    if (moe := summary["moe"]) is not None:
        print(
            f"MoE: {moe['rebalances']} rebalances, step imbalance (max / mean rank load) "
            f"{moe['step_imbalance_before_first_rebalance']} before the first, "
            f"{moe['step_imbalance_after_first_rebalance']} after"
        )
    return 0


def _cluster(args: argparse.Namespace) -> ClusterConfig:
    from daemon.sim.cluster import ClusterConfig
    from daemon.sim.node import NodeConfig

    node = NodeConfig(
        args.device_kv_gb * GB,
        args.host_cache_gb * GB,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        moe_config(args),
        spec_config(args),
    )
    return ClusterConfig(
        args.nodes,
        node,
        args.store_gb * GB,
        args.policy,
        args.time_scale,
        args.prefill,
        args.decode,
        Bandwidth(args.link_gb_s * 1e9, args.link_latency_ms / 1e3),
        args.max_concurrency,
        args.request_ms / 1e3,
        args.overlap,
        PrefillBalance(args.prefill_balance_rel, args.prefill_balance_abs),
    )


def _plot(out: Path, name: str, *what: object) -> Path | None:
    """The PNG beside `out` by plot.`name`; None (and a line saying so) without matplotlib."""
    try:
        from daemon.sim import plot
    except ModuleNotFoundError:  # matplotlib: the `sim` extra
        print("deepinfer simulate: matplotlib is not installed (the `sim` extra): no plot")
        return None
    png = out.with_suffix(".png")
    getattr(plot, name)(*what, png)
    return png


def _sweep(
    args: argparse.Namespace, table: CostTable, trace: list[TraceRequest], cfg: ClusterConfig
) -> int:
    from daemon.sim.sweep import sweep

    hosts = args.sweep_host_gb or [args.host_cache_gb]
    stores = args.sweep_store_gb or [args.store_gb]
    result = sweep(
        table, trace, cfg, [h * GB for h in hosts], [s * GB for s in stores], not args.no_progress
    )
    result |= {"table": dataclasses.asdict(table.provenance), "trace": args.trace}
    out = Path(args.out)
    out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    png = _plot(out, "plot_sweep", result)
    for p in result["points"]:
        print(
            f"host {p['host_gb_per_node']} GB/node, store {p['store_gb']} GB: hit rate "
            f"{100 * p['hit_rate']:.1f} %, TTFT p99 {p['ttft_s']['p99']} s"
        )
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0


def _size(
    args: argparse.Namespace, table: CostTable, trace: list[TraceRequest], cfg: ClusterConfig
) -> int:
    from daemon.sim.cluster import SLO
    from daemon.sim.sizing import size

    hosts = [h * GB for h in (args.size_host_gb or [args.host_cache_gb])]
    slo = SLO(args.ttft_p99_s, args.tpot_p99_s)
    modes = tuple(m.strip() for m in args.size_modes.split(","))
    result = size(
        table, trace, cfg, slo, args.max_nodes, hosts, args.host_gb_cost, modes,
        not args.no_progress,
    )  # fmt: skip
    result |= {"table": dataclasses.asdict(table.provenance), "trace": args.trace}
    out = Path(args.out)
    out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    for mode, best in result["best"].items():
        if best is None:
            print(f"{mode}: nothing up to {args.max_nodes} nodes meets the SLOs")
        else:
            nodes = best["unified"] or best["prefill"] + best["decode"]
            print(
                f"{mode}: {nodes} nodes"
                + ("" if mode == "unified" else f", P:D {best['pd_ratio']}")
                + f", host {best['host_gb_per_node']} GB a node: TTFT p99 "
                f"{best['ttft_p99_s']} s, TPOT p99 {best['tpot_p99_s']} s"
            )
    print(f"{len(result['trials'])} runs; wrote {out}")
    return 0


def _counts(text: str) -> list[int]:
    """A comma-separated, strictly increasing list of counts >= 0 (a grid axis)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a list of integers like 1,8,32") from None
    if not values or values != sorted(set(values)) or values[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: counts must be >= 0 and increasing")
    return values


def _sizes(text: str) -> list[float]:
    """A comma-separated list of capacities in GB (inf: unlimited)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a list of numbers like 0,16,inf") from None
    if not values or any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: capacities must be numbers >= 0")
    return values


def _check(args: argparse.Namespace) -> str | None:
    if args.nodes is None:
        args.nodes = 0 if args.prefill or args.decode else 1
    if min(args.nodes, args.prefill, args.decode) < 0:
        return "--nodes, --prefill and --decode must be >= 0"
    if (args.prefill > 0) != (args.decode > 0):
        return "--prefill and --decode go together: a pair needs both"
    if args.nodes + args.prefill + args.decode < 1:
        return "--nodes must be at least 1 (or give --prefill and --decode)"
    if args.size:
        modes = {m.strip() for m in args.size_modes.split(",")}
        if not modes or not modes <= {"unified", "pairs"}:
            return "--size-modes must be unified, pairs or unified,pairs"
        if args.max_nodes < 1:
            return "--max-nodes must be at least 1"
        if not args.ttft_p99_s > 0 or not args.tpot_p99_s > 0 or not args.host_gb_cost >= 0:
            return "--ttft-p99-s and --tpot-p99-s must be positive, --host-gb-cost >= 0"
    if not args.link_gb_s > 0 or math.isinf(args.link_gb_s) or not args.link_latency_ms >= 0:
        return "--link-gb-s must be a positive number and --link-latency-ms >= 0"
    if not args.device_kv_gb > 0 or math.isinf(args.device_kv_gb):
        return "--device-kv-gb must be a positive number"
    for name in ("host_cache_gb", "store_gb"):
        value = getattr(args, name)
        if not value >= 0:
            return f"--{name.replace('_', '-')} must be >= 0"
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        return "--max-num-seqs and --max-num-batched-tokens must be at least 1"
    if not 0 <= args.request_ms < math.inf:
        return "--request-ms must be a number >= 0"
    if args.max_concurrency < 0:
        return "--max-concurrency must be >= 0 (0: no bound)"
    if not args.time_scale > 0 or math.isinf(args.time_scale):
        return "--time-scale must be a positive number"
    try:
        PrefillBalance(args.prefill_balance_rel, args.prefill_balance_abs)
    except ValueError as e:
        return f"--prefill-balance-rel / --prefill-balance-abs: {e}"
    try:
        moe_config(args)
    except ValueError as e:
        return f"--moe-*: {e}"
    try:
        spec_config(args)
    except ValueError as e:
        return f"--spec-*: {e}"
    return None
