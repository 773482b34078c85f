"""Real `deepinfer serve` processes for tests: start on a free port, wait until healthy, stop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from daemon.service.live_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited during startup"
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


def serve_command(port: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "daemon", "serve", "--port", str(port), *args]


def checkout_env() -> dict[str, str]:
    """The checkout first on the path, then whatever the caller's PYTHONPATH holds (packages
    kept elsewhere)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"PYTHONPATH": path}


def in_checkout(
    argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`argv` run to its end from the checkout's root in its environment (with `env` over it),
    output kept as text."""
    return subprocess.run(
        argv,
        cwd=ROOT,
        env=checkout_env() | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def spawn(
    port: int, args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`python -m daemon serve ARGS --port PORT`, its output to `log_path`; not waited for.
    `env`: variables added to the checkout's environment."""
    with log_path.open("wb") as log_file:
        return subprocess.Popen(
            serve_command(port, args),
            cwd=ROOT,
            env=checkout_env() | (env or {}),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


@contextlib.contextmanager
def daemon(
    args: list[str], log_path: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m daemon serve ARGS --port <free>`; yields (base url, process). Leaving the
    block kills the process if the test did not stop it."""
    port = free_port()
    proc = spawn(port, args, log_path, env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
