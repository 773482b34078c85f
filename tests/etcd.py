"""A real etcd (Debian's etcd-server) on loopback for tests: free ports, a temporary data dir;
skips with the reason when the binary is missing (.ci/run installs it)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.service.live_server import free_port


@dataclass
class Etcd:
    host: str
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return json.loads(r.read()).get("health") == "true"
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def etcd_server(data_dir: Path, log_path: Path, timeout: float = 30) -> Iterator[Etcd]:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("the etcd binary is missing (apt-get install etcd-server; .ci/run does)")
    client, peer = free_port(), free_port()
    args = [
        binary, "--name", "test", "--data-dir", str(data_dir),
        "--listen-client-urls", f"http://127.0.0.1:{client}",
        "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"test=http://127.0.0.1:{peer}",
        "--logger", "zap", "--log-level", "warn",
    ]  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(client):
            assert proc.poll() is None, f"etcd exited: {log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "etcd did not become healthy"
            time.sleep(0.1)
        yield Etcd("127.0.0.1", client, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
