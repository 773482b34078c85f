"""A daemon that cannot start says why in one structured line and exits 3, never with a
traceback: a taken port or an unusable admin socket path before the model loads, a missing or
damaged model or tokenizer, a KV budget that holds no block, a device that is not there; a log
file that cannot be opened on stderr."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from pathlib import Path

import orjson
import pytest
import torch

from daemon.build.startup import EXIT_STARTUP_FAILED
from tests.daemons import ROOT, checkout_env, free_port, serve_command, spawn


def serve_to_exit(args: list[str], port: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        serve_command(port or free_port(), [*args, "--no-kv-store"]),
        cwd=ROOT,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def failed_start(args: list[str], port: int | None = None) -> tuple[str, str]:
    """Runs `deepinfer serve ARGS` to its exit: (the startup_failed error, the whole output)."""
    done = serve_to_exit([*args, "--log-format", "json"], port)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_STARTUP_FAILED, output
    assert "Traceback" not in output
    events = [orjson.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "startup_failed" and events[-1]["level"] == "error"
    return events[-1]["error"], output


def test_a_taken_port_fails_the_start_before_the_model_loads(tiny_model_dir: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        error, output = failed_start(["--model", str(tiny_model_dir)], port)
    assert error == f"cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "model_loaded" not in output


async def test_a_port_taken_between_bind_and_listen() -> None:
    """Bound sockets with SO_REUSEADDR share a port until one listens: a second daemon that
    bound it too fails at its listen, with the same reason."""
    from aiohttp import web

    from daemon.api.http.config import ServerConfig
    from daemon.api.http.server import bind_tcp, start_server
    from daemon.build.startup import StartupError

    port = free_port()
    socks = bind_tcp("127.0.0.1", port)
    with socket.socket() as rival:
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rival.bind(("127.0.0.1", port))
        rival.listen()
        message = f"cannot listen on 127.0.0.1:{port}: Address already in use"
        with pytest.raises(StartupError, match=message):
            await start_server(web.Application(), ServerConfig(port=port), socks)
    for sock in socks:
        sock.close()


def test_an_admin_socket_path_that_cannot_be_made(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "admin.sock"
    error, output = failed_start(["--model", str(tiny_model_dir), "--admin-socket", str(path)])
    assert error == f"cannot create the admin socket {path}: File exists ({path.parent})"
    assert "model_loaded" not in output


@pytest.mark.parametrize("kind", ["regular file", "directory", "live socket"])
def test_an_admin_socket_path_taken_by_something_else(
    tiny_model_dir: Path, tmp_path: Path, kind: str
) -> None:
    """Only a stale socket (nobody listening) is replaced; a file, a directory or a socket
    another process serves stays as it is."""
    path = tmp_path / "admin.sock"
    with contextlib.ExitStack() as stack:
        if kind == "regular file":
            path.write_text("precious")
            reason = "it exists and is not a socket"
        elif kind == "directory":
            path.mkdir()
            reason = "it exists and is not a socket"
        else:
            live = stack.enter_context(socket.socket(socket.AF_UNIX))
            live.bind(str(path))
            live.listen()
            reason = "another process is listening on it"
        error, output = failed_start(["--model", str(tiny_model_dir), "--admin-socket", str(path)])
        assert error == f"cannot create the admin socket {path}: {reason}"
        assert "model_loaded" not in output
        assert path.exists()
    if kind == "regular file":
        assert path.read_text() == "precious"


def test_a_stale_admin_socket_is_replaced(tmp_path: Path) -> None:
    from daemon.api.http.admin import bind_admin

    path = tmp_path / "admin.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # a daemon that crashed: bound, not listening
        dead.bind(str(path))
    with bind_admin(str(path)) as sock:
        sock.listen()
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))


def test_sigterm_during_model_load_removes_the_admin_socket(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import signal
    import time

    path = tmp_path / "admin.sock"
    log = tmp_path / "d.log"
    args = ["--model", str(tiny_model_dir), "--admin-socket", str(path), "--no-kv-store"]
    proc = spawn(free_port(), [*args, "--log-format", "json"], log)
    try:
        deadline = time.monotonic() + 60
        while not path.exists():  # bound before the model loads
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert '"serving"' not in output, "the signal came after the model had loaded"
    assert "Traceback" not in output and '"event": "stopped"' in output
    assert not path.exists()


def test_a_log_file_that_cannot_be_opened(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Said on stderr, as the log is what failed."""
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "d.log"
    done = serve_to_exit(["--model", str(tiny_model_dir), "--log-file", str(path)])
    assert done.returncode == EXIT_STARTUP_FAILED
    assert done.stderr == f"deepinfer: cannot open the log file {path}: Not a directory\n"


def test_a_missing_model(tmp_path: Path) -> None:
    error, _ = failed_start(["--model", str(tmp_path / "none")])
    assert error == f"model: {tmp_path / 'none'} has no config.json"


def damaged_copy(model: Path, root: Path) -> Path:
    copy = root / "model"
    shutil.copytree(model, copy)
    return copy


def test_a_checkpoint_file_cut_short(tiny_model_dir: Path, tmp_path: Path) -> None:
    """As an interrupted copy leaves it."""
    model = damaged_copy(tiny_model_dir, tmp_path)
    weights = next(model.glob("*.safetensors"))
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 1000)
    error, _ = failed_start(["--model", str(model)])
    assert error.startswith(f"model {model}: {weights.name}: Error while deserializing header")


def test_a_damaged_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = damaged_copy(tiny_model_dir, tmp_path)
    (model / "tokenizer.json").write_text("{not json")
    error, _ = failed_start(["--model", str(model)])
    assert error.startswith(f"tokenizer {model / 'tokenizer.json'}: ")


def test_a_kv_budget_that_holds_no_block(tiny_model_dir: Path) -> None:
    error, _ = failed_start(["--model", str(tiny_model_dir), "--kv-cache-memory-gb", "0.000001"])
    assert error.startswith("KV cache: 0.0 MiB of KV memory hold no block")
    assert error.endswith("raise kv_cache_memory_gb or lower max_num_seqs")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_a_device_that_is_not_there(tiny_model_dir: Path) -> None:
    error, _ = failed_start(["--model", str(tiny_model_dir), "--device", "cuda"])
    assert error == "device cuda: torch sees no CUDA device"


def test_a_start_that_cannot_honour_max_model_len_says_so(tiny_model_dir: Path) -> None:
    """Not failures: a max_model_len above the model's is lowered, and a KV pool smaller than
    one request of it still serves shorter ones; each start says so in a warning."""
    from structlog.testing import capture_logs

    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    cfg = EngineConfig(
        model=str(tiny_model_dir), max_model_len=10**8, kv_cache_memory_gb=0.0002, max_num_seqs=2
    )
    with capture_logs() as logs:
        engine, _ = build_engine(cfg)
    warnings = {e["event"]: e for e in logs if e["log_level"] == "warning"}
    supported = warnings["max_model_len_lowered"]["model_supports"]
    assert engine.max_model_len == supported < 10**8
    pool = warnings["kv_pool_below_max_model_len"]
    assert pool["kv_capacity_tokens"] == engine.kv.capacity_tokens() < supported


def test_an_admin_socket_whose_listener_does_not_accept_is_in_use(tmp_path: Path) -> None:
    """A daemon stopped (SIGSTOP) with its backlog full: the probe gives up at once, where a
    blocking connect would hang the start for as long as that daemon stays stopped."""
    import threading

    from daemon.api.http.admin import bind_admin
    from daemon.build.startup import StartupError

    path = tmp_path / "admin.sock"
    with contextlib.ExitStack() as stack:
        stopped = stack.enter_context(socket.socket(socket.AF_UNIX))
        stopped.bind(str(path))
        stopped.listen(0)
        while True:  # fill its backlog: nobody accepts
            client = stack.enter_context(socket.socket(socket.AF_UNIX))
            client.setblocking(False)
            try:
                client.connect(str(path))
            except BlockingIOError:
                break
        outcome: list[BaseException | None] = []

        def probe() -> None:
            try:
                bind_admin(str(path)).close()
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        thread.join(5)
        assert outcome, "the probe of a listener that does not accept hung"
        assert isinstance(outcome[0], StartupError)
        reason = "another process is listening on it"
        assert str(outcome[0]) == f"cannot create the admin socket {path}: {reason}"
        assert path.exists()


async def test_a_sigterm_as_the_start_hands_over_its_sockets_leaks_nothing(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM just after the sockets pass to the server (ExitStack.pop_all) goes to the
    handler the daemon had before (here one that notes it), not to the start's own: the daemon
    serves, and the next SIGTERM stops it, sockets and admin socket file gone; it used to return
    at once, leaving them (and the built engine) behind."""
    import asyncio
    import os
    import signal

    import aiohttp

    from daemon.api.http.config import ServerConfig
    from daemon.build.config import EngineConfig
    from daemon.service.daemon import serve
    from daemon.service.settings import Settings

    pop_all = contextlib.ExitStack.pop_all

    def pop_all_then_sigterm(self: contextlib.ExitStack) -> contextlib.ExitStack:
        popped = pop_all(self)
        signal.raise_signal(signal.SIGTERM)
        return popped

    noted: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: noted.append(signum))
    monkeypatch.setattr(contextlib.ExitStack, "pop_all", pop_all_then_sigterm)
    admin, port = tmp_path / "admin.sock", free_port()
    settings = Settings(
        engine=EngineConfig(model=str(tiny_model_dir), kv_cache_memory_gb=0.02),
        server=ServerConfig(port=port, admin_socket=str(admin)),
    )
    try:
        served = asyncio.create_task(serve(settings))
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                assert not served.done(), "the daemon stopped on a SIGTERM it had handed on"
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.1)
        monkeypatch.undo()
        assert noted == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # now the serving daemon's own handler
        assert await asyncio.wait_for(served, 60) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not admin.exists()
    with socket.socket() as again:  # the port is free again
        again.bind(("127.0.0.1", port))
