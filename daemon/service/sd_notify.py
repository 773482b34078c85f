"""The systemd notify protocol, spoken directly: datagrams to $NOTIFY_SOCKET (a path, or an
abstract socket when it starts with '@'). READY/STATUS/STOPPING, and WATCHDOG pings sent from
the event loop itself, so a loop that stalls stops pinging and systemd restarts the daemon."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import structlog

log = structlog.get_logger(__name__)


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as e:
            log.warning("sd_notify_failed", error=str(e))
            return False
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self, status: str = "draining") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def start_watchdog(self) -> None:
        """Ping at half of WatchdogSec (systemd passes it as WATCHDOG_USEC) from the loop."""
        interval = watchdog_interval_s()
        if self._sock is None or interval is None or self._watchdog is not None:
            return
        self._watchdog = asyncio.create_task(self._ping(interval), name="sd-watchdog")

    async def _ping(self, interval: float) -> None:
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2e6, 0.05)
    except ValueError:
        return None
