"""A prefill / decode node's role while it serves, and its live change: stop admitting work of
the old role, let what runs finish (drain), switch (the same model: no reload), register again
with the new role. Work of a role is counted while it runs, so the drain knows when it is done."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import structlog

from daemon.cluster.announce import Announcer
from daemon.cluster.node import Role

log = structlog.get_logger(__name__)

CHANGEABLE: tuple[Role, ...] = ("prefill", "decode")
POLL_S = 0.02


class RoleChangeError(Exception):
    """A role change refused or undone; `code` names why (bad_role, busy, drain_timeout)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class LiveRole:
    def __init__(self, role: Role) -> None:
        self.role = role
        self.draining = False  # a change drains the current role
        self.in_flight: Counter[str] = Counter()

    def admits(self, role: str) -> bool:
        return self.role == role and not self.draining

    @contextmanager
    def serving(self, role: str) -> Iterator[None]:
        """Counts one piece of `role` work while it runs (the caller checked `admits`)."""
        self.in_flight[role] += 1
        try:
            yield
        finally:
            self.in_flight[role] -= 1

    def load(self) -> dict[str, int]:
        """What the heartbeat adds to the engine's load: `draining` while a change drains."""
        return {"draining": 1} if self.draining else {}


class RoleChanger:
    """One change at a time; `announcer` is None where the node registers nowhere."""

    def __init__(self, live: LiveRole, announcer: Announcer | None, drain_timeout_s: float) -> None:
        self.live, self.announcer, self.drain_timeout_s = live, announcer, drain_timeout_s
        self._lock = asyncio.Lock()

    async def change(self, role: str) -> dict[str, object]:
        """Drains, switches and registers again; the change goes on to its end when the caller
        is cancelled (a client gone), so a node is never left draining."""
        return await asyncio.shield(self._change(role))

    async def _change(self, role: str) -> dict[str, object]:
        if role not in CHANGEABLE:
            raise RoleChangeError(f"role: {role!r} is not one of prefill, decode", "bad_role")
        if self._lock.locked():
            raise RoleChangeError("a role change is already under way", "busy")
        async with self._lock:
            old = self.live.role
            if old == role:
                return {"changed": False, "role": role}
            started = time.monotonic()
            self.live.draining = True
            log.info("role_change_draining", old=old, new=role, in_flight=self.live.in_flight[old])
            await self._refresh()
            if not await self._drained(old, started + self.drain_timeout_s):
                self.live.draining = False
                await self._refresh()
                log.warning("role_change_undone", old=old, new=role, reason="drain_timeout")
                raise RoleChangeError(
                    f"{self.live.in_flight[old]} {old} requests still ran after "
                    f"{self.drain_timeout_s:g} s; the node stays {old}",
                    "drain_timeout",
                )
            drained_s = time.monotonic() - started
            self.live.role, self.live.draining = cast(Role, role), False
            if self.announcer is not None:
                await self.announcer.set_role(cast(Role, role))
            log.info("role_changed", old=old, new=role, drain_s=round(drained_s, 3))
            return {"changed": True, "role": role, "previous": old, "drain_s": drained_s}

    async def _drained(self, role: str, deadline: float) -> bool:
        while self.live.in_flight[role] > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def _refresh(self) -> None:
        if self.announcer is not None:
            await self.announcer.refresh()
