"""The drafters a server may be given by name (`--speculative`)."""

from __future__ import annotations

from collections.abc import Callable

from daemon.loop.spec.base import Drafter
from daemon.loop.spec.device_drafter import DeviceDrafter
from daemon.loop.spec.ngram import NgramDrafter
from daemon.loop.spec.suffix import SuffixDrafter

DRAFTERS: dict[str, Callable[[int], Drafter]] = {
    "ngram": lambda k: NgramDrafter(),
    "suffix": lambda k: SuffixDrafter(),
    # drafted on the device by the runner (build_engine gives it the network): the target's
    # first layers, or a separate small model with the target's tokenizer (--draft-model)
    "layer-skip": lambda k: DeviceDrafter("layer-skip"),
    "draft-model": lambda k: DeviceDrafter("draft-model"),
    # DeepSeek-V4's MTP layer (build_engine gives the runner its network)
    "mtp": lambda k: DeviceDrafter("mtp"),
}


def build_drafter(name: str, k: int) -> Drafter:
    """The drafter called `name`, for drafts of at most `k` tokens."""
    if k < 1:
        raise ValueError(f"a drafter needs k >= 1 draft tokens (got {k})")
    make = DRAFTERS.get(name)
    if make is None:
        raise ValueError(f"unknown drafter {name!r}: expected one of {', '.join(DRAFTERS)}")
    return make(k)
