"""`deepinfer simulate`'s speculation flags: every node verifies drafts by the daemon's policy
(sim/spec_config.py), off unless --spec-policy is given."""

from __future__ import annotations

import argparse

from daemon.loop.spec.policy import POLICIES
from daemon.sim.spec_config import SpecConfig


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    d = SpecConfig()
    g = p.add_argument_group("speculative decoding (the daemon's verify-length policy)")
    g.add_argument(
        "--spec-policy", choices=POLICIES, default=None, help="verify lengths (default: off)"
    )
    g.add_argument("--spec-k", type=int, default=d.k, help="the most drafts a request verifies")
    g.add_argument(
        "--spec-acceptance",
        type=float,
        default=d.acceptance,
        help="a draft token's chance to be accepted, given those before it",
    )
    g.add_argument(
        "--spec-spread",
        type=float,
        default=d.spread,
        help="each request's rate uniform in acceptance +- this",
    )
    g.add_argument("--spec-seed", type=int, default=d.seed, help="acceptance draws")


def spec_config(args: argparse.Namespace) -> SpecConfig | None:
    """The flags' SpecConfig (None: no speculation); ValueError if they do not fit."""
    if args.spec_policy is None:
        return None
    return SpecConfig(
        args.spec_policy, args.spec_k, args.spec_acceptance, args.spec_spread, args.spec_seed
    )
