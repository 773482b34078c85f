"""The router's prefill-balance flags (`PrefillBalance`), one definition for `serve --role
router` and `deepinfer simulate`, which both hand them to the router's own code."""

from __future__ import annotations

import argparse

from daemon.cluster.router import PrefillBalance


def add_prefill_balance_flags(p: argparse._ActionsContainer, absent: bool = False) -> None:
    """`absent`: a flag not given is left out of the namespace (the settings file stands)."""
    d = PrefillBalance()
    p.add_argument(
        "--prefill-balance-rel",
        type=float,
        default=argparse.SUPPRESS if absent else d.rel,
        help="router: a prefill goes to the node that was sent the longest prefix of its prompt "
        "while that node's running + waiting requests are at most this many times the least "
        f"loaded prefill node's, or --prefill-balance-abs more; past that, load decides "
        f"(default {d.rel:g})",
    )
    p.add_argument(
        "--prefill-balance-abs",
        type=int,
        default=argparse.SUPPRESS if absent else d.abs,
        help=f"router: see --prefill-balance-rel (requests; default {d.abs})",
    )
