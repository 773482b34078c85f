"""HTTP discovery between real daemon processes: a prefill and a decode node register with a
seed peer and heartbeat their load; the seed restarting, a node frozen (SIGSTOP) or SIGKILLed
(its lease lapses) and a node SIGTERMed (it leaves at once)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.cluster.registry_routes import NODES
from daemon.service.live_server import free_port
from tests.daemons import spawn, wait_healthy

LEASE_S = 2.0  # heartbeats every 0.67 s


def node_args(model: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--served-model-name", "tiny", "--kv-cache-memory-gb", "0.02",
        "--max-num-seqs", "4", "--max-model-len", "512", "--no-kv-store", "--enforce-eager",
        "--log-format", "json",
        "--lease-s", str(LEASE_S), *extra,
    ]  # fmt: skip


@dataclass
class Proc:
    port: int
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        self.proc = spawn(self.port, self.args, self.log)
        return self

    def wait(self) -> Proc:
        assert self.proc is not None
        wait_healthy(self.url, self.proc, 120)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def nodes(registry: str, query: str = "") -> dict[str, dict]:
    with urllib.request.urlopen(registry + NODES + query, timeout=2) as r:
        return {n["node_id"]: n for n in json.loads(r.read())["data"]}


def until(check: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("cluster-logs")
    seed_port = free_port()
    seed_url = f"http://127.0.0.1:{seed_port}"
    # the seed registers with itself as a unified node of another KV layout (block size 32):
    # its fingerprint differs from the pair's
    procs = {
        "seed": Proc(
            seed_port,
            node_args(tiny_model_dir, "--block-size", "32", "--peers", seed_url, "--node-id", "u0"),
            logs / "seed.log",
        ),
        "p0": Proc(
            free_port(),
            node_args(tiny_model_dir, "--role", "prefill", "--peers", seed_url, "--node-id", "p0"),
            logs / "p0.log",
        ),
        "d0": Proc(
            free_port(),
            node_args(tiny_model_dir, "--role", "decode", "--peers", seed_url, "--node-id", "d0"),
            logs / "d0.log",
        ),
    }
    for p in procs.values():
        p.start()
    try:
        for p in procs.values():
            p.wait()
        yield procs
    finally:
        for p in procs.values():
            p.stop(signal.SIGKILL)


def test_nodes_register_with_role_fingerprint_and_load(cluster: dict) -> None:
    seed = cluster["seed"].url
    until(lambda: {"p0", "d0", "u0"} <= set(nodes(seed)), timeout=10)
    listed = nodes(seed)
    p0, d0, u0 = listed["p0"], listed["d0"], listed["u0"]
    assert (p0["role"], d0["role"], u0["role"]) == ("prefill", "decode", "unified")
    assert p0["url"] == cluster["p0"].url and d0["url"] == cluster["d0"].url
    assert p0["served_model"] == "tiny" and p0["epoch"] > 0
    assert p0["fingerprint"] == d0["fingerprint"] != u0["fingerprint"]
    assert set(d0["load"]) == {"running", "waiting", "kv_blocks_free"}
    assert d0["load"]["kv_blocks_free"] == d0["capacity"]["kv_blocks"] > 0
    assert d0["capacity"]["max_num_seqs"] == 4
    # never paired across fingerprints: what a router asks for
    pair = nodes(seed, f"?fingerprint={p0['fingerprint']}")
    assert set(pair) == {"p0", "d0"}
    assert set(nodes(seed, "?role=decode")) == {"d0"}


def test_registry_restart_nodes_register_again(cluster: dict) -> None:
    seed: Proc = cluster["seed"]
    until(lambda: {"p0", "d0"} <= set(nodes(seed.url)), timeout=10)
    epochs = {k: v["epoch"] for k, v in nodes(seed.url).items()}
    assert seed.stop() == 0
    seed.start().wait()
    until(lambda: {"p0", "d0", "u0"} <= set(nodes(seed.url)), timeout=LEASE_S + 2)
    after = nodes(seed.url)
    assert after["p0"]["epoch"] == epochs["p0"]  # the same processes
    assert after["u0"]["epoch"] > epochs["u0"]  # the seed itself restarted


def test_frozen_node_lapses_then_comes_back(cluster: dict) -> None:
    seed, p0 = cluster["seed"].url, cluster["p0"]
    until(lambda: "p0" in nodes(seed), timeout=10)
    epoch = nodes(seed)["p0"]["epoch"]
    p0.proc.send_signal(signal.SIGSTOP)  # no heartbeat leaves it
    try:
        until(lambda: "p0" not in nodes(seed), timeout=LEASE_S + 2)
    finally:
        p0.proc.send_signal(signal.SIGCONT)
    until(lambda: "p0" in nodes(seed), timeout=LEASE_S)  # forgotten: it registers again
    assert nodes(seed)["p0"]["epoch"] == epoch


def test_sigkill_lease_lapses(cluster: dict) -> None:
    seed = cluster["seed"].url
    until(lambda: "p0" in nodes(seed), timeout=10)
    cluster["p0"].stop(signal.SIGKILL)
    gone = until(lambda: "p0" not in nodes(seed), timeout=LEASE_S + 2)
    assert gone > 0.3  # it lapsed; nobody told the seed
    assert "d0" in nodes(seed)


def test_sigterm_leaves_at_once(cluster: dict) -> None:
    seed = cluster["seed"].url
    until(lambda: "d0" in nodes(seed), timeout=10)
    d0: Proc = cluster["d0"]
    assert d0.proc is not None
    d0.proc.send_signal(signal.SIGTERM)
    until(lambda: "d0" not in nodes(seed), timeout=1.5)
    assert d0.proc.wait(timeout=20) == 0
    # it said so (DELETE), rather than its lease lapsing
    left = [
        json.loads(line)
        for line in cluster["seed"].log.read_text().splitlines()
        if "node_left" in line
    ]
    assert [e["node_id"] for e in left] == ["d0"]
