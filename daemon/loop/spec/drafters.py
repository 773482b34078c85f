"""The drafters a server may be given by name (`--speculative`)."""

from __future__ import annotations

from collections.abc import Callable

from daemon.loop.spec.base import Drafter
from daemon.loop.spec.layerskip import LayerSkipDrafter
from daemon.loop.spec.ngram import NgramDrafter
from daemon.loop.spec.suffix import SuffixDrafter

DRAFTERS: dict[str, Callable[[int], Drafter]] = {
    "ngram": lambda k: NgramDrafter(),
    "suffix": lambda k: SuffixDrafter(),
    # the target's first layers, on the device (the runner drafts: build_engine's draft_layers)
    "layer-skip": lambda k: LayerSkipDrafter(),
}


def build_drafter(name: str, k: int) -> Drafter:
    """The drafter called `name`, for drafts of at most `k` tokens."""
    if k < 1:
        raise ValueError(f"a drafter needs k >= 1 draft tokens (got {k})")
    make = DRAFTERS.get(name)
    if make is None:
        raise ValueError(f"unknown drafter {name!r}: expected one of {', '.join(DRAFTERS)}")
    return make(k)
