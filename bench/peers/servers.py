"""One server process per system (deepinfer, vLLM-CPU, llama.cpp) on 127.0.0.1:<port>: its
command line, readiness with a timeout, and teardown of its whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from bench.peers.venvs import PeerEnv

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("deepinfer", "vllm", "llamacpp")
# Measured with both cores (issue 18): vLLM-CPU by default keeps one core for itself.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


class ServerError(Exception):
    """The server exited or did not become ready; the message holds its log's tail."""


@dataclass
class Launch:
    """What to run for one system: argv, extra environment, the name it serves."""

    system: str
    argv: list[str]
    served_name: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT


def deepinfer_launch(
    model: Path, port: int, dtype: str, extra: list[str], store: Path | None = None
) -> Launch:
    """The block store on, as by default, in `store`: a directory of this server's own (the
    default one outlives the process, and an earlier run's blocks would turn this run's
    prompts into prefix hits that the peers cannot have); None: `--no-kv-store`. KV memory as
    vLLM's (4 GiB: 64 requests of 384 tokens need more than the default 1 GiB in fp32)."""
    name = "deepinfer-bench"
    argv = [sys.executable, "-m", "daemon", "serve", "--model", str(model), "--dtype", dtype]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", name]
    argv += ["--kv-store-dir", str(store)] if store is not None else ["--no-kv-store"]
    argv += ["--kv-cache-memory-gb", VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"], *extra]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return Launch("deepinfer", argv, name, {"PYTHONPATH": path})


def vllm_launch(env: PeerEnv, model: Path, port: int, dtype: str, extra: list[str]) -> Launch:
    """`python -m vllm.entrypoints.openai.api_server`: the `vllm` console script fails in the
    vllm-cpu distribution (it looks up metadata of a package named `vllm`)."""
    name = "vllm-bench"
    argv = [str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", name, *extra]
    return Launch("vllm", argv, name, dict(VLLM_ENV))


def llamacpp_launch(env: PeerEnv, gguf: Path, port: int, extra: list[str]) -> Launch:
    """The GGUF as shipped (its own quantization): a reference point, not a like-for-like. All
    cores (its default is half for decode), and a new request must not cut off the one being
    streamed (`interrupt_requests`, on by default)."""
    name = "llamacpp-bench"
    cores = str(os.cpu_count() or 1)
    argv = [str(env.python), "-m", "llama_cpp.server", "--model", str(gguf)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--model_alias", name]
    argv += ["--n_threads", cores, "--n_threads_batch", cores, "--interrupt_requests", "False"]
    argv += extra
    return Launch("llamacpp", argv, name)


class Server:
    """A started Launch in its own process group (its workers die with it); a context manager
    that stops it on exit."""

    def __init__(self, launch: Launch, port: int, log_path: Path) -> None:
        self.launch, self.port, self.log_path = launch, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                launch.argv,
                cwd=launch.cwd,
                env=os.environ | launch.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until GET /v1/models answered 200; ServerError on exit or timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.launch.system} exited with {self.proc.returncode} during startup:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(
            f"{self.launch.system} not ready after {timeout_s:g} s:\n" + self.log_tail()
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the whole group; SIGKILL to what is left of it after `grace_s` (children
        that outlive the leader, engine cores and workers, are in the same group)."""
        pgid = self.proc.pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        self.proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
