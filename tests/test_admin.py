"""The admin socket of a real daemon: mode 0600 (another user cannot connect), the
`deepinfer admin` client's commands, and clear errors (never a crash) for malformed ones."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest

from daemon.service.admin_client import call
from tests.checkpoints import make_v4_checkpoint
from tests.daemons import ROOT, daemon


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin")
    checkpoint = make_v4_checkpoint(tmp / "v4", n_routed_experts=8)
    run = Path(tempfile.mkdtemp(prefix="deepinfer-admin-"))
    run.chmod(0o755)  # others may reach the socket: only its own mode keeps them out
    sock = run / "admin.sock"
    args = [
        "--model", str(checkpoint), "--served-model-name", "v4", "--kv-cache-memory-gb", "0.01",
        "--no-kv-store", "--admin-socket", str(sock), "--moe-stats-interval", "1",
    ]  # fmt: skip
    with daemon(args, tmp / "d.log") as (url, proc):
        yield url, sock, proc
    shutil.rmtree(run, ignore_errors=True)


def admin(sock: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "daemon", "admin", "--socket", str(sock), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )


CONNECT = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1]); print('in')"


def connect_as(user: str, sock: Path) -> subprocess.CompletedProcess:
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    return subprocess.run(
        [python, "-c", CONNECT, str(sock)], capture_output=True, text=True, user=user, timeout=30
    )


def test_socket_is_private(served) -> None:
    _, sock, _ = served
    mode = stat.S_IMODE(os.stat(sock).st_mode)
    assert stat.S_ISSOCK(os.stat(sock).st_mode) and mode == 0o600
    if os.geteuid() != 0:
        pytest.skip("connecting as another user needs root to switch users")
    nobody = pwd.getpwnam("nobody").pw_name
    refused = connect_as(nobody, sock)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr
    sock.chmod(0o666)  # the control: with the mode opened up, the same user gets in
    try:
        assert connect_as(nobody, sock).stdout.strip() == "in"
    finally:
        sock.chmod(0o600)


async def health(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url + "/health") as r:
        return r.status, (await r.json())["status"]


def test_commands(served) -> None:
    url, sock, proc = served
    status = json.loads(admin(sock, "status").stdout)
    assert status["model"] == "v4" and status["moe"]["experts"] == 8 and not status["draining"]

    async def complete() -> int:
        body = {"model": "v4", "prompt": [5, 6, 7, 8], "max_tokens": 3}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/completions", json=body) as r,
        ):
            return r.status

    assert asyncio.run(complete()) == 200
    load = json.loads(admin(sock, "expert-load").stdout)
    assert load["window_intervals"] >= 1 and len(load["layers"]) == 3
    assert sum(load["layers"][1]["expert_load"]) > 0
    drained = admin(sock, "drain")
    assert drained.returncode == 0 and json.loads(drained.stdout)["draining"]
    assert asyncio.run(complete()) == 503
    assert asyncio.run(health(url)) == (503, "draining")  # load balancers take it out
    assert admin(sock, "resume").returncode == 0
    assert asyncio.run(complete()) == 200
    assert asyncio.run(health(url)) == (200, "ok")
    done = admin(sock, "set-intervals", "--stats", "50", "--rebalance", "0")
    assert done.returncode == 0 and json.loads(done.stdout)["stats_interval"] == 50
    assert proc.poll() is None


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/intervals", b"{nope", 400, "not valid JSON"),
        ("POST", "/intervals", b"[1]", 400, "JSON object"),
        ("POST", "/intervals", b'{"stats_interval": 0}', 400, "stats_interval"),
        ("POST", "/intervals", b'{"every": 5}', 400, "unknown fields"),
        ("POST", "/intervals", b"{}", 400, "give stats_interval"),
        ("POST", "/rebalance", b"", 409, "not spread over ranks"),
        ("GET", "/nope", b"", 404, "Invalid URL"),
        ("DELETE", "/status", b"", 405, "Invalid URL"),
    ],
)
def test_malformed_commands_get_errors(served, method, path, body, status, words) -> None:
    _, sock, proc = served

    async def send() -> tuple[int, dict]:
        connector = aiohttp.UnixConnector(path=str(sock))
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.request(method, "http://admin" + path, data=body) as r,
        ):
            return r.status, await r.json(content_type=None)

    got, answer = asyncio.run(send())
    assert got == status and words in answer["error"]["message"], answer
    assert asyncio.run(call(str(sock), "status"))[0] == 200 and proc.poll() is None
