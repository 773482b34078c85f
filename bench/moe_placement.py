"""Expert-parallel load balance of the MoE placement policies on a simulated DeepSeek-V4-class
cluster (384 experts, 64 ranks, 7 slots per rank), with drifting expert popularity.

    python -m bench.moe_placement [--steps 200000 --zipf 0.4 0.6 0.8 1.0 --drift 0.05 --json F]

Each layer's expert popularity is Zipf(s) over a permutation of the experts that random-walks
(adjacent swaps in popularity order, `--drift` rank steps per expert per 1000 steps). A step
routes ranks x tokens-per-rank x top-k assignments, drawn multinomially. Load statistics are
sampled every `--sample-every` steps into a moving window of `--window` samples (a
`daemon.moe.stats.LoadWindow`, which also keeps the drift statistics); every
`--rebalance-every` steps each policy re-places from that window. `--drift-kind ou` replaces the
swaps by continuous drift: every expert's log-popularity is an Ornstein-Uhlenbeck process
(`--ou-sigma` stationary std, `--ou-rho` correlation per 1000 steps). Every sample period keeps
`--measure-steps` steps drawn exactly like the others (not all 1000, for time) and measures each
policy's max/mean rank load on those actual steps, so stale statistics are penalised. Before the
first rebalance all policies run the static layout; those steps are not measured.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from daemon.moe.eplb_reference import eplb_global, eplb_hierarchical
from daemon.moe.placement import (
    Placement,
    balanced_placement,
    hot_replica_placement,
    moved_slots,
    rank_share,
    robust_placement,
    static_placement,
)
from daemon.moe.stats import LoadWindow, SwapModel

# (window load, true popularity now, previous placement, the load window) -> placement
PlaceFn = Callable[[np.ndarray, np.ndarray, Placement, LoadWindow], Placement]


@dataclass
class Policy:
    name: str
    place: PlaceFn
    every_sample: bool = False  # oracle: re-placed from the true popularity every sample period


@dataclass
class Tally:
    """One policy in one layer: per measured step, the max and mean rank load."""

    step_max: list[np.ndarray] = field(default_factory=list)
    step_mean: list[np.ndarray] = field(default_factory=list)
    window_ratio: list[float] = field(default_factory=list)
    drift_tv: list[float] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)
    place_s: list[float] = field(default_factory=list)
    swap_model: SwapModel | None = None  # the drift LoadWindow fitted, at the end


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--slots", type=int, default=7, help="slots per rank (residents + replicas)")
    ap.add_argument(
        "--zipf",
        type=float,
        nargs="+",
        default=[0.4, 0.6, 0.8, 1.0],
        help="Zipf exponent of each simulated layer",
    )
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--sample-every", type=int, default=1000)
    ap.add_argument("--rebalance-every", type=int, default=10_000)
    ap.add_argument("--window", type=int, default=10, help="samples in the moving window")
    ap.add_argument(
        "--half-life",
        type=float,
        default=0.0,
        help="weigh window samples by 0.5**(age/half-life); 0: plain sum",
    )
    ap.add_argument("--tokens-per-rank", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument(
        "--drift", type=float, default=0.05, help="popularity-rank steps per expert per 1000 steps"
    )
    ap.add_argument("--drift-kind", choices=["swaps", "ou"], default="swaps")
    ap.add_argument("--ou-sigma", type=float, default=0.3, help="ou: stationary log-load std")
    ap.add_argument("--ou-rho", type=float, default=0.99, help="ou: correlation per 1000 steps")
    ap.add_argument(
        "--measure-steps", type=int, default=200, help="measured steps per sample period"
    )
    ap.add_argument("--nodes", type=int, default=8, help="EPLB hierarchical: nodes")
    ap.add_argument("--groups", type=int, default=8, help="EPLB hierarchical: expert groups")
    ap.add_argument(
        "--keep-tolerance",
        type=float,
        default=0.01,
        help="ours: relative slack on the busiest rank allowed to keep experts put",
    )
    ap.add_argument("--scenarios", type=int, default=32, help="robust: drift scenarios")
    ap.add_argument(
        "--sharpness", type=float, default=60.0, help="robust: soft-max sharpness (1/rank mean)"
    )
    ap.add_argument(
        "--move-cost",
        type=float,
        default=5e-5,
        help="robust: gain (rank-mean units) a swap needs per slot it moves",
    )
    ap.add_argument(
        "--drift-memory", type=float, default=100.0, help="robust: swap statistics memory, samples"
    )
    ap.add_argument(
        "--ablations",
        action="store_true",
        help="also: ours on the latest sample, robust with the drift fitted on the window only, "
        "robust without move cost",
    )
    ap.add_argument("--no-oracle", action="store_true", help="skip the oracle policy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--plot", help="PNG of max/mean per sample period (needs matplotlib)")
    return ap.parse_args()


def make_policies(args: argparse.Namespace) -> list[Policy]:
    e, r, s = args.experts, args.ranks, args.slots
    static = static_placement(e, r, s)
    tol = args.keep_tolerance
    horizon = args.rebalance_every / args.sample_every

    def robust(
        win: LoadWindow, prev: Placement, window_fit: bool = False, move_cost: float | None = None
    ) -> Placement:
        return robust_placement(
            win.samples(0),
            r,
            s,
            prev,
            drift=None if window_fit else win.swap_model(0),
            horizon=horizon,
            scenarios=args.scenarios,
            sharpness=args.sharpness,
            move_cost=args.move_cost if move_cost is None else move_cost,
        )

    policies = [
        Policy("static (no replicas)", lambda w, p, prev, win: static),
        Policy(
            "ours", lambda w, p, prev, win: balanced_placement(w, r, s, prev, keep_tolerance=tol)
        ),
        Policy("ours, robust to drift", lambda w, p, prev, win: robust(win, prev)),
        Policy("ours, from scratch", lambda w, p, prev, win: balanced_placement(w, r, s)),
        Policy("EPLB global", lambda w, p, prev, win: eplb_global(w, r, s)),
        Policy(
            f"EPLB hier. {args.nodes}n/{args.groups}g",
            lambda w, p, prev, win: eplb_hierarchical(w, r, s, args.groups, args.nodes),
        ),
        Policy("static + hot replicas", lambda w, p, prev, win: hot_replica_placement(w, static)),
    ]
    if args.ablations:
        policies[3:3] = [
            Policy(
                "ours, latest sample",
                lambda w, p, prev, win: balanced_placement(
                    win.samples(0)[-1], r, s, prev, keep_tolerance=tol
                ),
            ),
            Policy(
                "robust, drift fit on window",
                lambda w, p, prev, win: robust(win, prev, window_fit=True),
            ),
            Policy(
                "robust, no move cost", lambda w, p, prev, win: robust(win, prev, move_cost=0.0)
            ),
        ]
    if not args.no_oracle:
        policies.append(
            Policy(
                "oracle (true p, every sample)",
                lambda w, p, prev, win: balanced_placement(p, r, s),
                every_sample=True,
            )
        )
    return policies


def simulate_layer(
    layer: int, zipf_s: float, args: argparse.Namespace, policies: list[Policy]
) -> dict[str, Tally]:
    rng = np.random.default_rng([args.seed, layer])
    n = args.experts
    popularity = 1.0 / np.arange(1, n + 1) ** zipf_s
    order = rng.permutation(n)  # order[k] = the expert k-th in popularity
    per_step = args.ranks * args.tokens_per_rank * args.top_k
    periods = args.steps // args.sample_every
    rebalance = args.rebalance_every // args.sample_every
    swaps = round(args.drift * n / 2 * args.sample_every / 1000)
    history: deque[np.ndarray] = deque(maxlen=args.window)
    win = LoadWindow(args.window, args.drift_memory)
    log_p = np.empty(n)
    log_p[order] = np.log(popularity)
    ou = rng.normal(0.0, args.ou_sigma, n) if args.drift_kind == "ou" else None
    start = static_placement(n, args.ranks, args.slots)
    current = {p.name: start for p in policies}
    shares = {p.name: rank_share(start, n) for p in policies}
    tallies = {p.name: Tally() for p in policies}

    def estimate() -> np.ndarray:
        samples = np.asarray(history, dtype=np.float64)
        if args.half_life <= 0:
            return samples.sum(0)
        age = np.arange(len(samples))[::-1]
        return (0.5 ** (age / args.half_life)) @ samples

    last_p: np.ndarray | None = None

    def place(policy: Policy, w: np.ndarray, p: np.ndarray) -> None:
        t = time.perf_counter()
        new = policy.place(w, p, current[policy.name], win)
        tally = tallies[policy.name]
        tally.place_s.append(time.perf_counter() - t)
        tally.moved.append(moved_slots(current[policy.name], new))
        current[policy.name], shares[policy.name] = new, rank_share(new, n)

    for k in range(periods):
        if ou is not None:
            rho = args.ou_rho ** (args.sample_every / 1000)
            ou = rho * ou + np.sqrt(1 - rho**2) * args.ou_sigma * rng.normal(size=n)
            p = np.exp(log_p + ou)
        else:
            for i in rng.integers(0, n - 1, swaps):
                order[i], order[i + 1] = order[i + 1], order[i]
            p = np.empty(n)
            p[order] = popularity
        p /= p.sum()
        if k >= rebalance:
            counts = rng.multinomial(per_step, p, size=args.measure_steps).astype(np.float64)
            for policy in policies:
                if policy.every_sample:
                    place(policy, p, p)
                loads = counts @ shares[policy.name]
                tally = tallies[policy.name]
                tally.step_max.append(loads.max(1))
                tally.step_mean.append(loads.mean(1))
                tally.window_ratio.append(float((loads.max(1) / loads.mean(1)).mean()))
        history.append(rng.multinomial(per_step * args.sample_every, p))
        win.add(torch.from_numpy(history[-1][None]))
        if (k + 1) % rebalance == 0:
            if last_p is not None:
                tallies[policies[0].name].drift_tv.append(0.5 * float(np.abs(p - last_p).sum()))
            last_p = p
            window = estimate()
            for policy in policies:
                if not policy.every_sample:
                    place(policy, window, p)
    tallies[policies[0].name].swap_model = win.swap_model(0)
    return tallies


def summarise(policies: list[Policy], layers: list[dict[str, Tally]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in policies:
        tallies = [layer[policy.name] for layer in layers]
        mx = np.stack([np.concatenate(t.step_max) for t in tallies])  # [layers, steps]
        mean = np.stack([np.concatenate(t.step_mean) for t in tallies])
        ratio = mx / mean
        moved = [m for t in tallies for m in t.moved]
        times = [s for t in tallies for s in t.place_s]
        out[policy.name] = {
            "max_over_mean": float(ratio.mean()),
            "p99_max_over_mean": float(np.percentile(ratio, 99)),
            "per_layer": [float(x) for x in ratio.mean(1)],
            # a step waits for every layer's busiest rank: ideal time / actual time
            "pct_of_ideal": float(100 * (mean.sum(0) / mx.sum(0)).mean()),
            "moved_per_rebalance": float(np.mean(moved)) if not policy.every_sample else None,
            "place_ms_mean": 1e3 * float(np.mean(times)),
            "place_ms_max": 1e3 * float(np.max(times)),
            "window_ratio": [t.window_ratio for t in tallies],
        }
    return out


def print_table(args: argparse.Namespace, results: dict[str, Any]) -> None:
    slots = args.ranks * args.slots
    drift = (
        f"OU drift sigma {args.ou_sigma} rho {args.ou_rho}"
        if args.drift_kind == "ou"
        else f"drift {args.drift}"
    )
    print(
        f"\n{args.experts} experts, {args.ranks} ranks x {args.slots} slots, "
        f"{args.steps} steps, Zipf {args.zipf}, {drift}, "
        f"{args.ranks * args.tokens_per_rank * args.top_k} assignments/step, "
        f"window {args.window} x {args.sample_every} steps, rebalance every "
        f"{args.rebalance_every}"
    )
    head = (
        f"{'policy':32} {'max/mean':>9} {'p99':>7} {'% ideal':>8} "
        f"{'moved/rebal':>14} {'place ms':>9}  per layer max/mean"
    )
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        moved = r["moved_per_rebalance"]
        moved_s = "-" if moved is None else f"{moved:.1f} ({100 * moved / slots:.0f}%)"
        layers = " ".join(f"{x:.3f}" for x in r["per_layer"])
        print(
            f"{name:32} {r['max_over_mean']:9.3f} {r['p99_max_over_mean']:7.3f} "
            f"{r['pct_of_ideal']:7.1f}% {moved_s:>14} {r['place_ms_mean']:9.1f}  {layers}"
        )


def time_ours(args: argparse.Namespace, reps: int = 5) -> dict[str, float]:
    """Our placements for one layer: from scratch, and re-placing after a small drift (robust:
    from a window of 10 samples, the seed cadence's drift model)."""
    rng = np.random.default_rng(args.seed)
    n, r, s = args.experts, args.ranks, args.slots
    load = (1.0 / np.arange(1, n + 1) ** max(args.zipf))[rng.permutation(n)]
    per_sample = r * args.tokens_per_rank * args.top_k * args.sample_every
    samples = rng.multinomial(per_sample, load / load.sum(), size=10).astype(np.float64)
    drift = SwapModel(0.02)
    horizon = args.rebalance_every / args.sample_every
    out = {}
    for name, place in (
        ("", lambda w, prev: balanced_placement(w[-1], r, s, prev)),
        ("robust_", lambda w, prev: robust_placement(w, r, s, prev, drift=drift, horizon=horizon)),
    ):
        t0 = time.perf_counter()
        for _ in range(reps):
            prev = place(samples, None)
        t1 = time.perf_counter()
        for _ in range(reps):
            place(samples * np.exp(rng.normal(0.0, 0.05, n)), prev)
        t2 = time.perf_counter()
        out[f"{name}scratch_ms"] = 1e3 * (t1 - t0) / reps
        out[f"{name}with_previous_ms"] = 1e3 * (t2 - t1) / reps
    return out


def plot(path: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(args.zipf), figsize=(5 * len(args.zipf), 4), sharey=True)
    for i, (ax, s) in enumerate(zip(np.atleast_1d(axes), args.zipf, strict=True)):
        for name, r in results.items():
            ratio = r["window_ratio"][i]
            x = (
                np.arange(len(ratio)) + args.rebalance_every // args.sample_every
            ) * args.sample_every
            ax.plot(x, ratio, label=name, lw=1)
        ax.set_title(f"layer {i}: Zipf {s}")
        ax.set_xlabel("step")
    np.atleast_1d(axes)[0].set_ylabel("max / mean rank load")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    args = parse_args()
    policies = make_policies(args)
    t = time.perf_counter()
    layers = [simulate_layer(i, s, args, policies) for i, s in enumerate(args.zipf)]
    results = summarise(policies, layers)
    drift_tv = [float(np.mean(layer[policies[0].name].drift_tv or [0.0])) for layer in layers]
    print_table(args, results)
    print(
        "popularity drift per rebalance interval (total variation, % of routed load): "
        + " ".join(f"{100 * d:.1f}%" for d in drift_tv)
    )
    timing = time_ours(args)
    print(
        "drift fitted by LoadWindow.swap_model (swap probability per sample interval of equal "
        "neighbours, log-gap scale): "
        + "  ".join(
            f"{m.flip:.4f}/{m.scale:.3g}"
            for m in (layer[policies[0].name].swap_model for layer in layers)
            if m is not None
        )
    )
    print()
    for name, label in (("", "ours"), ("robust_", "ours, robust")):
        print(
            f"{label}, one layer {args.experts}/{args.ranks}/{args.slots}: "
            f"{timing[name + 'scratch_ms']:.1f} ms from scratch, "
            f"{timing[name + 'with_previous_ms']:.1f} ms with a previous placement"
        )
    print(f"simulation wall time {time.perf_counter() - t:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "results": results,
                    "timing": timing,
                    "drift_tv": drift_tv,
                    "swap_models": [
                        vars(layer[policies[0].name].swap_model or SwapModel()) for layer in layers
                    ],
                },
                f,
                indent=1,
            )
    if args.plot:
        plot(args.plot, args, results)


if __name__ == "__main__":
    main()
