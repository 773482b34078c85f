"""What a node daemon runs to be found: an Announcer (HTTP registrar or etcd) started after the
server listens and told to leave on drain. `Load` reads the engine's load when asked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Load = Callable[[], dict[str, int]]  # {"running", "waiting", "kv_blocks_free"}


class Announcer(Protocol):
    async def start(self) -> None:
        """Begins registering and heartbeating in the background; returns at once (a peer that
        is down or slow never holds the node's start)."""
        ...

    async def leave(self) -> None:
        """Stops heartbeating and deregisters, within a bounded time; never raises."""
        ...
