"""A live role change between real daemons (a router, two nodes of a tiny random model on
127.0.0.1): through the admin HTTP call (bearer token; 401 without, in the API's error shape)
and the admin socket (`deepinfer admin set-role`); a node moved while it streams drains that
stream to its end, no request fails meanwhile, and it then serves its new role, same process;
the router's autoscaler moving a node by that call."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from openai import OpenAI
from prometheus_client import generate_latest

from daemon.api.http.cluster_autoscale import RouterAutoscaler
from daemon.api.http.cluster_state import RouterState
from daemon.cluster.autoscale import Autoscaler, Decision, Targets
from daemon.cluster.node import NodeInfo
from daemon.cluster.peers import PeerSet
from daemon.cluster.registry_routes import NODES
from daemon.cluster.router import Router
from daemon.service.live_server import free_port
from tests.daemons import ROOT, checkout_env, spawn, wait_healthy

TOKEN = "role-change-token-7f3a"
NAME = "tiny"
PROMPT = list(range(1000, 1040))
LONG = 160  # tokens streamed across the change


def _args(model: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--served-model-name", NAME, "--kv-cache-memory-gb", "0.02",
        "--max-num-seqs", "4", "--max-model-len", "512", "--no-kv-store", "--enforce-eager",
        "--cpu-threads", "1", "--log-format", "json", "--lease-s", "3", *extra,
    ]  # fmt: skip


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _until(check, timeout: float = 10.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("role-change")
    ports = {k: free_port() for k in ("router", "n1", "n2")}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    args = {
        "router": ["--role", "router", "--lease-s", "3", "--log-format", "json"],
        "n1": _args(tiny_model_dir, "--role", "decode", "--node-id", "n1"),
        "n2": _args(tiny_model_dir, "--role", "prefill", "--node-id", "n2"),
    }
    for node in ("n1", "n2"):
        args[node] += ["--peers", urls["router"], "--admin-socket", str(tmp / f"{node}.sock")]
    env = {"DEEPINFER_SERVER_ADMIN_TOKEN": TOKEN}
    procs = {k: spawn(ports[k], a, tmp / f"{k}.log", env) for k, a in args.items()}
    try:
        for k, proc in procs.items():
            wait_healthy(urls[k], proc, 120)
        _until(
            lambda: (
                _get(urls["router"] + "/health")["nodes"]
                == {"prefill": 1, "decode": 1, "unified": 0}
            )
        )
        yield {"urls": urls, "procs": procs, "tmp": tmp}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    for k in procs:  # no secret reaches a log
        assert TOKEN not in (tmp / f"{k}.log").read_text()


def _roles(router: str) -> dict[str, str]:
    return {n["node_id"]: n["role"] for n in _get(router + NODES)["data"]}


def _draining(router: str, node: str) -> bool:
    return any(
        n["node_id"] == node and n["load"].get("draining") for n in _get(router + NODES)["data"]
    )


def _oai(router: str) -> OpenAI:
    return OpenAI(base_url=router + "/v1", api_key="x", max_retries=0, timeout=60)


def _complete(router: str, max_tokens: int) -> str:
    out = _oai(router).completions.create(
        model=NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return out.choices[0].text


def test_admin_call_needs_the_token_and_a_role(cluster: dict) -> None:
    url = cluster["urls"]["n2"] + "/admin/v1/role"
    for token in (None, "wrong"):
        status, body = _post(url, {"role": "decode"}, token)
        assert status == 401
        assert body["error"]["code"] == "invalid_api_key"
        assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = _post(url, {"role": "router"})
    assert status == 400 and body["error"]["param"] == "role"
    status, body = _post(url, {"role": "prefill"})  # already
    assert status == 200 and body["changed"] is False


def test_a_streaming_node_drains_then_serves_its_new_role(cluster: dict) -> None:
    urls, procs = cluster["urls"], cluster["procs"]
    router = urls["router"]
    short, long = _complete(router, 8), _complete(router, LONG)  # n2 prefills, n1 decodes
    # n2 idle: moves at once
    status, body = _post(urls["n2"] + "/admin/v1/role", {"role": "decode"})
    assert status == 200 and body["changed"] and body["previous"] == "prefill"
    assert _roles(router) == {"n1": "decode", "n2": "decode"}  # registered before answering

    stream = _oai(router).completions.create(
        model=NAME, prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts, moved, answers = [], None, {}
    for chunk in stream:
        texts.append(chunk.choices[0].text if chunk.choices else "")
        if len(texts) == 3:  # the node streaming it goes prefill now, mid-stream
            moved = next(k for k in ("n1", "n2") if _get(urls[k] + "/health")["running"])
            change = threading.Thread(
                target=lambda url=urls[moved]: answers.update(
                    moved=_post(url + "/admin/v1/role", {"role": "prefill"})
                )
            )
            change.start()
            other = "n2" if moved == "n1" else "n1"
            # the router sees the drain (a heartbeat at once) and sends new work elsewhere
            _until(lambda node=moved: _draining(router, node))
            assert _complete(router, 8) == short
    change.join(30)
    assert "".join(texts) == long  # the stream ran to its end on the draining node
    status, body = answers["moved"]
    assert status == 200 and body["changed"] and body["previous"] == "decode"
    assert body["drain_s"] > 0.05  # it waited for the stream
    assert _roles(router) == {moved: "prefill", other: "decode"}
    # the same process prefills now: a handoff from it to the other node
    exported = _get(urls[moved] + "/health")["kv_handoff_exported"]
    imported = _get(urls[other] + "/health")["kv_handoff_imported"]
    assert _complete(router, 8) == short
    assert _get(urls[moved] + "/health")["kv_handoff_exported"] == exported + 1
    assert _get(urls[other] + "/health")["kv_handoff_imported"] == imported + 1
    assert all(p.poll() is None for p in procs.values())


def test_admin_socket_set_role(cluster: dict) -> None:
    router = cluster["urls"]["router"]
    node = next(k for k, r in _roles(router).items() if r == "prefill")
    sock = cluster["tmp"] / f"{node}.sock"
    cmd = [sys.executable, "-m", "daemon", "admin", "--socket", str(sock), "set-role", "decode"]
    done = subprocess.run(cmd, cwd=ROOT, env=checkout_env(), capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["changed"] and answer["role"] == "decode"
    assert set(_roles(router).values()) == {"decode"}
    assert _complete(router, 8)  # served, locally computed: no prefill node is left


def test_the_router_autoscaler_moves_a_node_through_its_admin_call(cluster: dict) -> None:
    """The router's autoscaler (in this process, over the real nodes): slow first tokens in its
    window and idle decode nodes move one node to prefill, by the node's admin HTTP call."""
    router = cluster["urls"]["router"]
    assert set(_roles(router).values()) == {"decode"}

    async def scale() -> tuple[Decision, str]:
        peers = PeerSet()
        for n in _get(router + NODES)["data"]:
            peers.upsert(NodeInfo.from_json(n), 30)
        state = RouterState(Router(peers), url=router, lease_ms=1000, created=0)
        targets = Targets(ttft_p99_s=1.0, tpot_p99_s=1.0)
        scaler = RouterAutoscaler(state, Autoscaler(targets), 10, TOKEN, 30)
        for _ in range(20):
            state.slo.add(time.monotonic(), 3.0, 0.01)  # TTFT 3x its target
        async with aiohttp.ClientSession() as state.session:
            decision = await scaler.tick()
        return decision, generate_latest(state.metrics.registry).decode()

    decision, metrics = asyncio.run(scale())
    assert decision.kind == "decode_to_prefill" and decision.inputs.ttft_p99_s == 3.0
    assert _roles(router)[decision.node_id] == "prefill"
    assert 'deepinfer:autoscale_decisions_total{kind="decode_to_prefill"} 1.0' in metrics
    assert 'deepinfer:autoscale_moves_total{result="ok"} 1.0' in metrics
    assert 'deepinfer:autoscale_input{name="ttft_p99_s"} 3.0' in metrics
    assert 'deepinfer:autoscale_nodes{role="decode"} 2.0' in metrics
