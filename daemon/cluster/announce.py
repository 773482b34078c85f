"""What a node daemon runs to be found: an Announcer (HTTP registrar or etcd) started after the
server listens and told to leave on drain; a live role change refreshes it and sets its role.
`Load` reads the engine's load when asked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from daemon.cluster.node import Role

Load = Callable[[], dict[str, int]]  # {"running", "waiting", "kv_blocks_free"[, "draining"]}


class Announcer(Protocol):
    async def start(self) -> None:
        """Begins registering and heartbeating in the background; returns at once (a peer that
        is down or slow never holds the node's start)."""
        ...

    async def leave(self) -> None:
        """Stops heartbeating and deregisters, within a bounded time; never raises."""
        ...

    async def refresh(self) -> None:
        """Sends the node's load now (a drain starting or undone); never raises."""
        ...

    async def set_role(self, role: Role) -> None:
        """Registers again, now, with `role` (a live role change); never raises."""
        ...
