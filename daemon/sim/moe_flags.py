"""`deepinfer simulate`'s MoE flags: a MoE model under expert parallelism on every node
(sim/moe_config.py), off unless --moe-experts is given."""

from __future__ import annotations

import argparse

from daemon.sim.moe_config import MoEConfig


def add_moe_flags(p: argparse.ArgumentParser) -> None:
    d = MoEConfig()
    g = p.add_argument_group(
        "MoE (the daemon's expert load statistics and placement, on each node's steps)"
    )
    g.add_argument(
        "--moe-experts", type=int, default=0, help="routed experts a MoE layer (0: a dense model)"
    )
    g.add_argument("--moe-experts-per-token", type=int, default=d.experts_per_token)
    g.add_argument("--moe-ep-ranks", type=int, default=d.ranks, help="expert-parallel ranks")
    g.add_argument(
        "--moe-slots-per-rank",
        type=int,
        default=d.slots_per_rank,
        help="expert slots a rank, redundant ones included (0: every expert once plus one)",
    )
    g.add_argument(
        "--moe-layers", type=int, default=d.layers, help="MoE layers (each its own popularity)"
    )
    g.add_argument(
        "--moe-zipf",
        type=float,
        default=d.zipf,
        help="routing skew: the i-th most popular expert's weight ~ 1/i**s (0: uniform)",
    )
    g.add_argument(
        "--moe-drift",
        type=float,
        default=d.drift,
        help="popularity drift: swaps of two adjacent experts per step, expected (0: none)",
    )
    g.add_argument(
        "--moe-share",
        type=float,
        default=d.share,
        help="the MoE layers' part of a step's table time, which waits for the busiest rank "
        f"(the table has no MoE part; default {d.share:g})",
    )
    g.add_argument(
        "--moe-stats-interval",
        type=int,
        default=d.stats_interval,
        help="steps between expert-load samples (as serve)",
    )
    g.add_argument(
        "--moe-rebalance-interval",
        type=int,
        default=d.rebalance_interval,
        help="steps between placements (as serve; 0: placement off)",
    )
    g.add_argument("--moe-window", type=int, default=d.window, help="samples a placement sees")
    g.add_argument("--moe-seed", type=int, default=d.seed, help="routing draws")


def moe_config(args: argparse.Namespace) -> MoEConfig | None:
    """The flags' MoEConfig (None for a dense model); ValueError if they do not fit."""
    if args.moe_experts <= 0:
        return None
    return MoEConfig(
        args.moe_experts,
        args.moe_experts_per_token,
        args.moe_ep_ranks,
        args.moe_slots_per_rank,
        args.moe_layers,
        args.moe_zipf,
        args.moe_drift,
        args.moe_share,
        args.moe_stats_interval,
        args.moe_rebalance_interval,
        args.moe_window,
        args.moe_seed,
    )
