"""The notify protocol on real datagram sockets: a daemon process sends READY, WATCHDOG and
STOPPING in order (abstract socket address), and watchdog pings come from the event loop,
so they stop while the loop is blocked."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid
from pathlib import Path

from daemon.service.sd_notify import Notifier
from tests.daemons import daemon


def _datagrams(sock: socket.socket, until: float) -> list[str]:
    out = []
    while time.monotonic() < until:
        sock.settimeout(max(until - time.monotonic(), 0.01))
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            break
    return out


def test_daemon_notifies_ready_watchdog_stopping(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    name = f"deepinfer-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # ping every 0.1 s
    args = ["--model", str(tiny_model_dir), "--kv-cache-memory-gb", "0.01", "--no-kv-store"]
    with daemon(args, tmp_path / "d.log") as (_, proc):
        got = _datagrams(sock, time.monotonic() + 1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    got += _datagrams(sock, time.monotonic() + 0.5)
    sock.close()
    kinds = [
        next(
            f
            for f in g.split("\n")
            if f.split("=")[0] in ("READY", "WATCHDOG", "STOPPING", "STATUS")
        )
        for g in got
    ]
    assert kinds[0] == "READY=1" and f"MAINPID={proc.pid}" in got[0], got
    assert kinds.count("WATCHDOG=1") >= 5, got
    stopping = kinds.index("STOPPING=1")
    assert all(k == "WATCHDOG=1" for k in kinds[1:stopping])


async def test_watchdog_pings_stop_while_the_loop_is_blocked(tmp_path: Path, monkeypatch) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # every 0.05 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = Notifier(path)
    notifier.start_watchdog()

    def drain() -> int:
        n = 0
        while True:
            try:
                n += sock.recv(64) == b"WATCHDOG=1"
            except BlockingIOError:
                return n

    await asyncio.sleep(0.5)
    assert drain() >= 5  # the loop runs: pings flow
    time.sleep(0.6)  # the loop is blocked: nothing may be sent meanwhile
    assert drain() <= 1  # (one may have been sent just before the block)
    await asyncio.sleep(0.5)
    assert drain() >= 5
    await notifier.close()
    sock.close()
    os.unlink(path)
