"""A router, a prefill and a decode daemon (real processes on 127.0.0.1, a tiny random dense
model with a chat template) against a unified daemon: the same greedy answers through the
router, the KV handed over, its full blocks through the block store the two nodes share (one
corrupted or removed there: still the same answer); then the failures: a node that refuses
connections (retried), a client gone mid-stream (every block back), a stale epoch (at the
prefill node, and through the router), the prefill node SIGKILLed during the handoff and
before it (computed on the decode node), the router stopped mid-stream (the stream ends) and
restarted, the decode node frozen past its lease mid-stream (the stream goes on), a node gone
past the router's grace (the stream ends with an error event), the decode node SIGKILLed
mid-stream (a clean error), none left (503)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from anthropic import Anthropic
from openai import APIError, NotFoundError, OpenAI

from daemon.cluster.kv_source import HttpKVSource, PrefillNode
from daemon.cluster.node import NodeInfo
from daemon.loop.handoff import HandoffFailed
from daemon.service.live_server import free_port
from tests.checkpoints import make_dense_checkpoint
from tests.daemons import spawn, wait_healthy

NAME = "tiny-chat"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = list(range(1000, 1150))  # 150 tokens: 9 full blocks of 16 and a partial one
HANDOFF_TIMEOUT_S = 3  # a frozen prefill node costs this much
CHAT = [{"role": "user", "content": "Tell me a story about a router and two nodes. " * 6}]


@dataclass
class Node:
    url: str
    proc: subprocess.Popen

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())


@dataclass
class Cluster:
    router: Node
    prefill: Node
    decode: Node
    unified: Node
    router_command: tuple[int, list[str], Path]  # port, args, log: to start it again
    node_args: list[str]  # what the prefill and decode nodes were given, less their cluster part
    store: Path  # the block store the prefill and decode nodes share

    def restart_router(self) -> None:
        self.router.proc.kill()
        self.router.proc.wait()
        port, args, log = self.router_command
        self.router.proc = spawn(port, args, log.with_suffix(".again.log"))
        wait_healthy(self.router.url, self.router.proc, 60)


def _model_args(model: Path, name: str, store: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--served-model-name", name, "--kv-cache-memory-gb", "0.02",
        "--max-num-seqs", "4", "--max-model-len", "1024", "--kv-store-dir", str(store),
        "--enforce-eager", "--cpu-threads", "1", "--log-format", "json", *extra,
    ]  # fmt: skip


def _cluster_args(role: str, router: str, node_id: str) -> list[str]:
    return [
        "--role", role, "--peers", router, "--node-id", node_id, "--lease-s", "3",
        "--handoff-timeout-s", str(HANDOFF_TIMEOUT_S),
    ]  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _until(check, timeout: float = 20.0, what: str = "the condition"):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.1)


def start_cluster(
    model: Path,
    tmp: Path,
    name: str,
    extra: tuple[str, ...] = (),
) -> Iterator[Cluster]:
    """Router, prefill and decode nodes (one block store) and a unified node (its own store)
    serving `model` as `name`; stopped after."""
    ports = {role: free_port() for role in ("router", "prefill", "decode", "unified")}
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    router_args = ["--role", "router", "--lease-s", "3", "--log-format", "json"]
    router_args += ["--prefill-balance-rel", "2", "--prefill-balance-abs", "6"]
    node = _model_args(model, name, tmp / "store", *extra)
    args = {
        "router": router_args + ["--handoff-timeout-s", "10"],
        "prefill": node + _cluster_args("prefill", urls["router"], "p0"),
        "decode": node + _cluster_args("decode", urls["router"], "d0"),
        "unified": _model_args(model, name, tmp / "unified-store", *extra),
    }
    procs: dict[str, subprocess.Popen] = {}
    nodes: dict[str, Node] = {}
    try:
        for role in args:
            procs[role] = spawn(ports[role], args[role], tmp / f"{role}.log")
        for role in args:
            wait_healthy(urls[role], procs[role], 120)
        nodes = {role: Node(urls[role], procs[role]) for role in args}
        command = (ports["router"], args["router"], tmp / "router.log")
        _until(
            lambda: nodes["router"].health()["nodes"] == {"prefill": 1, "decode": 1, "unified": 0},
            what="both nodes registered",
        )
        yield Cluster(**nodes, router_command=command, node_args=node, store=tmp / "store")
    finally:
        for role, proc in procs.items():
            _stop(nodes[role].proc if role == "router" and nodes else proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = make_dense_checkpoint(
        tmp_path_factory.mktemp("tiny-chat"), with_tokenizer=True, max_position_embeddings=2048
    )
    cfg_path = model / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"chat_template": TEMPLATE}))
    yield from start_cluster(model, tmp_path_factory.mktemp("cluster"), NAME)


def _oai(node: Node) -> OpenAI:
    return OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _complete(node: Node, stream: bool, prompt: list[int] = PROMPT, max_tokens: int = 8) -> str:
    kwargs = dict(
        model=NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        return _oai(node).completions.create(**kwargs).choices[0].text
    chunks = _oai(node).completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _chat(node: Node, stream: bool) -> str:
    kwargs = dict(
        model=NAME, messages=CHAT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    if not stream:
        return _oai(node).chat.completions.create(**kwargs).choices[0].message.content
    chunks = _oai(node).chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _idle(node: Node) -> dict:
    def check() -> dict | None:
        h = node.health()
        done = h["running"] == 0 and h["waiting"] == 0
        return h if done and h["kv_blocks_free"] == h["kv_blocks_total"] else None

    return _until(check, 10, f"{node.url} idle with every block free")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_through_the_router_equal_a_unified_node(
    cluster: Cluster, stream: bool
) -> None:
    before = cluster.decode.health()["kv_handoff_imported"]
    exported = cluster.prefill.health()["kv_handoff_exported"]
    seconds = [cluster.decode.health()["kv_handoff_seconds_by_phase"]]
    seconds.append(cluster.prefill.health()["kv_handoff_seconds_by_phase"])
    routed = _complete(cluster.router, stream)
    assert routed == _complete(cluster.unified, stream)
    assert cluster.decode.health()["kv_handoff_imported"] == before + 1
    assert cluster.prefill.health()["kv_handoff_exported"] == exported + 1
    # each phase's time was counted on the side it runs on
    for node, phases in (
        (cluster.decode, ("fetch", "import")),
        (cluster.prefill, ("export", "send")),
    ):
        now = node.health()["kv_handoff_seconds_by_phase"]
        assert all(now[p] > seconds[0 if node is cluster.decode else 1][p] for p in phases)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_router_equals_a_unified_node(cluster: Cluster, stream: bool) -> None:
    before = cluster.decode.health()["kv_handoff_imported"]
    assert _chat(cluster.router, stream) == _chat(cluster.unified, stream)
    assert cluster.decode.health()["kv_handoff_imported"] == before + 1


def _store_files(cluster: Cluster) -> set[Path]:
    return set((cluster.store / "v1").rglob("*.kvb"))


def _handoff_counts(cluster: Cluster) -> dict[str, int]:
    d, p = cluster.decode.health(), cluster.prefill.health()
    return {
        "imported": d["kv_handoff_imported"],
        "recomputed": d["kv_handoff_recomputed"],
        "wire": d["kv_handoff_bytes_imported"],
        "from_store": d["kv_handoff_bytes_from_store"],
        "blocks": d["kv_handoff_blocks_from_store"],
        "fallbacks": d["kv_handoff_store_fallbacks"],
        "bad_files": d["kv_store_bad_files"],
        "stored": p["kv_handoff_blocks_stored"],
    }


def _routed(cluster: Cluster, prompt: list[int]) -> dict[str, int]:
    """The prompt through the router equals the unified node's answer; the counters grown."""
    before = _handoff_counts(cluster)
    assert _complete(cluster.router, False, prompt) == _complete(cluster.unified, False, prompt)
    return {k: v - before[k] for k, v in _handoff_counts(cluster).items()}


def test_full_blocks_come_through_the_shared_store(cluster: Cluster) -> None:
    """The prompt's 9 full blocks through the block store the two nodes share, the partial
    last one over HTTP; a stored block corrupted after the prefill node published it is fetched
    again over HTTP; one removed is sent by the prefill node; every block back after."""
    prompt = list(range(3000, 3150))  # 9 full blocks of [0, 149), then 5 tokens
    files = _store_files(cluster)
    grown = _routed(cluster, prompt)
    assert (grown["imported"], grown["blocks"], grown["stored"], grown["fallbacks"]) == (1, 9, 9, 0)
    block_bytes = grown["from_store"] // 9
    assert grown["wire"] == block_bytes  # over HTTP: the partial block's bytes alone
    ours = _until(lambda: len(new := _store_files(cluster) - files) == 9 and new, 5, "9 files")

    # the same prompt again: the prefill node finds its blocks published (it cannot tell
    # that one file's payload was altered); the decode node's read finds it out
    victim = sorted(ours)[4]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    grown = _routed(cluster, prompt)
    assert (grown["imported"], grown["fallbacks"], grown["recomputed"]) == (1, 1, 0)
    assert (grown["bad_files"], grown["blocks"]) == (1, 0)
    assert grown["wire"] == 10 * block_bytes  # fetched again: everything over HTTP
    with urllib.request.urlopen(cluster.decode.url + "/metrics", timeout=5) as r:
        assert "deepinfer:kv_handoff_store_fallbacks_total 1.0" in r.read().decode()

    # a file removed: the prefill node names only the blocks before it, sends the rest
    prompt = list(range(3200, 3350))
    files = _store_files(cluster)
    _routed(cluster, prompt)
    ours = _until(lambda: len(new := _store_files(cluster) - files) == 9 and new, 5, "9 files")
    sorted(ours)[0].unlink()
    grown = _routed(cluster, prompt)
    assert (grown["imported"], grown["fallbacks"]) == (1, 0) and grown["blocks"] < 9
    assert grown["wire"] == (10 - grown["blocks"]) * block_bytes
    _idle(cluster.decode)
    _idle(cluster.prefill)


def test_the_router_lists_the_model_and_counts(cluster: Cluster) -> None:
    models = _oai(cluster.router).models.list()
    assert [m.id for m in models.data] == [NAME]
    with urllib.request.urlopen(cluster.router.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'deepinfer:router_requests_total{path="/v1/completions"}' in text
    assert 'deepinfer:router_prefill_routes_total{prefix="hit"}' in text  # the same prompt again
    # the prefill route's load bound, from the router's flags
    assert cluster.router.health()["prefill_balance"] == {"rel": 2.0, "abs": 6}


def test_an_unknown_model_is_a_404_in_each_protocol(cluster: Cluster) -> None:
    with pytest.raises(NotFoundError) as info:
        _oai(cluster.router).completions.create(model="nope", prompt="hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    client = Anthropic(base_url=cluster.router.url, api_key="x", max_retries=0, timeout=30)
    with pytest.raises(Exception) as info:
        client.messages.create(
            model="nope", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert getattr(info.value, "status_code", None) == 404
    assert info.value.body["error"]["type"] == "not_found_error"


def test_a_decode_node_that_refuses_connections_is_retried_elsewhere(cluster: Cluster) -> None:
    """A registered decode node with nothing listening (and the lightest load, so it is picked
    first): the request goes on to the live one."""
    dead = NodeInfo(
        node_id="d-dead",
        role="decode",
        fingerprint="unused",
        url=f"http://127.0.0.1:{free_port()}",
        epoch=1,
        served_model=NAME,
        capacity={"kv_blocks": 1000, "max_num_seqs": 1000},
        load={"running": 0, "waiting": 0, "kv_blocks_free": 1000},
    )
    body = json.dumps(dead.to_json() | {"ttl_s": 30}).encode()
    req = urllib.request.Request(
        cluster.router.url + "/cluster/v1/nodes",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=5).close()
    try:
        assert _complete(cluster.router, False) == _complete(cluster.unified, False)
        with urllib.request.urlopen(cluster.router.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "deepinfer:router_retries_total 1.0" in text
        assert 'deepinfer:router_failures_total{reason="connect"} 1.0' in text
    finally:
        gone = urllib.request.Request(
            cluster.router.url + "/cluster/v1/nodes/d-dead?epoch=1", method="DELETE"
        )
        urllib.request.urlopen(gone, timeout=5).close()


async def test_a_client_gone_mid_stream_frees_every_block_on_both_nodes(cluster: Cluster) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    body = {
        "model": NAME,
        "prompt": PROMPT[::-1],
        "max_tokens": 800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    url = cluster.router.url + "/v1/completions"
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url, json=body) as resp,
    ):
        assert resp.status == 200
        await resp.content.readline()  # the first event: the decode node runs it
        assert cluster.decode.health()["running"] == 1
        # leaving the block unread closes the connection
    start = time.monotonic()
    _idle(cluster.decode)
    assert time.monotonic() - start < 2
    _idle(cluster.prefill)
    assert cluster.router.health()["in_flight"] == 0


async def test_a_stale_epoch_is_refused_by_the_prefill_node(cluster: Cluster) -> None:
    node = json.loads(urllib.request.urlopen(cluster.router.url + "/cluster/v1/nodes").read())
    p0 = next(n for n in node["data"] if n["node_id"] == "p0")
    async with aiohttp.ClientSession() as session:
        stale = PrefillNode("p0", p0["url"], p0["epoch"] - 1, 5000)
        source = HttpKVSource(
            session, cluster.router.url, "stale1", p0["fingerprint"], 5, prefill=stale
        )
        with pytest.raises(HandoffFailed, match="stale epoch"):
            await source.fetch(PROMPT, [], len(PROMPT) - 1)
        async with session.post(
            p0["url"] + "/cluster/v1/prefill", json={"request_id": "x", "epoch": 1}
        ) as resp:
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "stale_epoch"
    _idle(cluster.prefill)


def test_a_stale_epoch_through_the_router_is_computed_on_the_decode_node(
    cluster: Cluster,
) -> None:
    """The router still holds a registration of the prefill node from before a restart (its
    old epoch; registered here under another id, which it prefers: never routed to): the
    prefill node refuses the handoff (409), the decode node computes the prompt itself."""
    nodes = json.loads(urllib.request.urlopen(cluster.router.url + "/cluster/v1/nodes").read())
    p0 = next(n for n in nodes["data"] if n["node_id"] == "p0")
    stale = NodeInfo(
        node_id="a-stale",
        role="prefill",
        fingerprint=p0["fingerprint"],
        url=p0["url"],
        epoch=p0["epoch"] - 1,
        served_model=NAME,
        capacity=p0["capacity"],
        load={"running": 0, "waiting": 0, "kv_blocks_free": 1000},
    )
    body = json.dumps(stale.to_json() | {"ttl_s": 30}).encode()
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(cluster.router.url + "/cluster/v1/nodes", body, headers)
    urllib.request.urlopen(req, timeout=5).close()
    try:
        before = cluster.decode.health()["kv_handoff_recomputed_by_reason"]
        exported = cluster.prefill.health()["kv_handoff_exported"]
        prompt = list(range(3400, 3550))
        assert _complete(cluster.router, False, prompt) == _complete(cluster.unified, False, prompt)
        after = cluster.decode.health()["kv_handoff_recomputed_by_reason"]
        assert {r: n - before[r] for r, n in after.items() if n != before[r]} == {"failed": 1}
        assert cluster.prefill.health()["kv_handoff_exported"] == exported
    finally:
        url = cluster.router.url + f"/cluster/v1/nodes/a-stale?epoch={p0['epoch'] - 1}"
        urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=5).close()
    _idle(cluster.decode)
    _idle(cluster.prefill)


async def test_a_client_gone_during_the_handoff_frees_both_nodes(cluster: Cluster) -> None:
    """The prefill node frozen: the decode node waits on its handoff, blocks reserved, when
    the client goes; its abort ends the fetch, and the prefill node, woken, finds its client
    gone too."""
    body = {"model": NAME, "prompt": PROMPT[7:], "max_tokens": 4, "temperature": 0}
    cluster.prefill.proc.send_signal(signal.SIGSTOP)
    try:
        async with aiohttp.ClientSession() as session:
            url = cluster.router.url + "/v1/completions"
            ask = asyncio.create_task(session.post(url, json=body))
            health = await asyncio.to_thread(
                _until,
                lambda: (h := cluster.decode.health())["kv_blocks_free"] < h["kv_blocks_total"],
                5,
                "the decode node reserving blocks for the handoff",
            )
            assert health
            ask.cancel()
            with pytest.raises(asyncio.CancelledError):
                await ask
        start = time.monotonic()
        _idle(cluster.decode)
        assert time.monotonic() - start < 2
    finally:
        cluster.prefill.proc.send_signal(signal.SIGCONT)
    _idle(cluster.prefill)


def test_a_frozen_prefill_node_leaves_the_prompt_to_the_decode_node(cluster: Cluster) -> None:
    before = cluster.decode.health()["kv_handoff_recomputed"]
    prompt = PROMPT[3:]
    cluster.prefill.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        routed = _complete(cluster.router, False, prompt)
        assert time.monotonic() - start < HANDOFF_TIMEOUT_S + 3
    finally:
        cluster.prefill.proc.send_signal(signal.SIGCONT)
    assert routed == _complete(cluster.unified, False, prompt)
    assert cluster.decode.health()["kv_handoff_recomputed"] == before + 1
    _idle(cluster.decode)
    _idle(cluster.prefill)  # its handoff, cut off by the decode node, freed everything


def test_a_decode_node_frozen_past_its_lease_finishes_its_stream(cluster: Cluster) -> None:
    """A starved node misses heartbeats while it still computes: its lease lapses mid-stream
    (SIGSTOP until the router's set has lost it), and once it runs again it registers again
    and the stream goes on to the same answer; a request that came meanwhile (no live node
    of its model) waited for it; no failure is counted."""
    kwargs = dict(
        model=NAME, prompt=PROMPT, max_tokens=300, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = iter(_oai(cluster.router).completions.create(stream=True, **kwargs))
    text = []
    while not text:
        text = [c.text for c in next(chunks).choices if c.text]
    assert cluster.decode.health()["running"] == 1
    cluster.decode.proc.send_signal(signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        try:
            _until(lambda: cluster.router.health()["nodes"]["decode"] == 0, 10, "the lease lapsed")
            # a new request meanwhile waits for the node to come back, rather than a 503
            later = pool.submit(_complete, cluster.router, False, PROMPT[::2])
            time.sleep(1.0)  # a few of the router's polls see the node gone
            assert not later.done()
        finally:
            cluster.decode.proc.send_signal(signal.SIGCONT)
        text += [c.choices[0].text for c in chunks if c.choices]
        assert "".join(text) == _complete(cluster.unified, False, PROMPT, 300)
        assert later.result(timeout=60) == _complete(cluster.unified, False, PROMPT[::2])
    _until(lambda: cluster.router.health()["nodes"]["decode"] == 1, 10, "registered again")
    with urllib.request.urlopen(cluster.router.url + "/metrics", timeout=5) as r:
        assert "node_lost" not in r.read().decode()
    # the router did wait on the node while it was out of the set
    assert '"serving_node_lapsed"' in cluster.router_command[2].read_text()
    _idle(cluster.decode)


async def test_a_node_gone_past_the_grace_ends_the_stream(tmp_path: Path) -> None:
    """A node out of the router's set that sends nothing more is given up after
    --lost-node-grace-s: the stream ends with the protocol's error event. The node is an
    aiohttp server here that streams one event, then nothing, and never heartbeats."""
    done = asyncio.Event()  # the test is over: the handler returns (the cleanup waits for it)

    async def stalled(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        await asyncio.wait_for(done.wait(), 60)
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stalled)
    runner = web.AppRunner(app)
    await runner.setup()
    node_port, port = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", node_port).start()
    args = ["--role", "router", "--lost-node-grace-s", "1", "--log-format", "json"]
    router = spawn(port, args, tmp_path / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_healthy, url, router, 60)
        node = NodeInfo(
            node_id="d-stalls",
            role="decode",
            fingerprint="unused",
            url=f"http://127.0.0.1:{node_port}",
            epoch=1,
            served_model=NAME,
            capacity={"kv_blocks": 10, "max_num_seqs": 4},
            load={"running": 0, "waiting": 0, "kv_blocks_free": 10},
        )
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.post(url + "/cluster/v1/nodes", json=node.to_json() | {"ttl_s": 1}):
                pass
            body = {"model": NAME, "prompt": "hi", "stream": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert b'"text": "a"' in await resp.content.readline()
                start = time.monotonic()
                rest = await resp.read()
            # the lease (1 s) and the grace (1 s), then a poll (0.5 s)
            assert time.monotonic() - start < 8
            assert b"serving node failed" in rest and rest.endswith(b"data: [DONE]\n\n")
            async with session.get(url + "/metrics") as m:
                assert 'reason="stream_node_lost"' in await m.text()
    finally:
        done.set()
        _stop(router)
        await runner.cleanup()


def test_a_router_told_to_stop_finishes_the_streams_it_has(cluster: Cluster) -> None:
    """SIGTERM mid-stream: the stream runs to its end, the router exits 0; started again, the
    nodes register with it again."""
    kwargs = dict(
        model=NAME, prompt=PROMPT, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = iter(_oai(cluster.router).completions.create(stream=True, **kwargs))
    text = []
    while not text:
        text = [c.text for c in next(chunks).choices if c.text]
    cluster.router.proc.send_signal(signal.SIGTERM)
    text += [c.choices[0].text for c in chunks if c.choices]
    assert "".join(text) == _complete(cluster.unified, False, PROMPT, 200)
    assert cluster.router.proc.wait(timeout=30) == 0
    cluster.restart_router()
    _until(
        lambda: cluster.router.health()["nodes"] == {"prefill": 1, "decode": 1, "unified": 0},
        what="both nodes registered again",
    )


def test_a_restarted_router_learns_the_nodes_again(cluster: Cluster) -> None:
    cluster.restart_router()
    _until(
        lambda: cluster.router.health()["nodes"] == {"prefill": 1, "decode": 1, "unified": 0},
        what="both nodes registered again",
    )
    before = cluster.decode.health()["kv_handoff_imported"]
    assert _complete(cluster.router, True) == _complete(cluster.unified, True)
    assert cluster.decode.health()["kv_handoff_imported"] == before + 1


def test_a_prefill_node_killed_during_the_handoff_leaves_the_prompt_to_the_decode_node(
    cluster: Cluster,
) -> None:
    """Frozen with the decode node's fetch waiting on it, then SIGKILLed: the connection breaks
    and the decode node computes the prompt itself at once, not after the handoff's timeout."""
    before = cluster.decode.health()["kv_handoff_recomputed_by_reason"]
    prompt = PROMPT[9:]
    cluster.prefill.proc.send_signal(signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        routed = pool.submit(_complete, cluster.router, False, prompt)
        _until(
            lambda: cluster.decode.health()["kv_handoffs_in_flight"] > 0,
            5,
            "the decode node fetching from the frozen prefill node",
        )
        cluster.prefill.proc.kill()
        cluster.prefill.proc.wait()
        text = routed.result(timeout=30)
    assert text == _complete(cluster.unified, False, prompt)
    after = cluster.decode.health()["kv_handoff_recomputed_by_reason"]
    grown = {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)}
    assert grown == {"connection": 1}  # the broken connection, not the timeout
    _idle(cluster.decode)


def test_a_prefill_node_killed_leaves_the_prompt_to_the_decode_node(cluster: Cluster) -> None:
    """Dead before the handoff (still in the router's set until its lease lapses)."""
    cluster.prefill.proc.kill()
    cluster.prefill.proc.wait()
    before = cluster.decode.health()["kv_handoff_recomputed"]
    prompt = PROMPT[5:]  # not in the decode node's prefix cache
    assert _complete(cluster.router, False, prompt) == _complete(cluster.unified, False, prompt)
    assert cluster.decode.health()["kv_handoff_recomputed"] == before + 1
    _idle(cluster.decode)


def test_a_decode_node_killed_mid_stream_is_a_clean_error(cluster: Cluster) -> None:
    chunks = _oai(cluster.router).completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=800,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    start = None
    with pytest.raises(APIError, match="serving node failed"):
        for _ in chunks:
            if start is None:
                cluster.decode.proc.kill()
                start = time.monotonic()
    assert start is not None and time.monotonic() - start < 5
    cluster.decode.proc.wait()
    with pytest.raises(APIError) as info:
        _oai(cluster.router).completions.create(model=NAME, prompt="hi", max_tokens=1)
    assert getattr(info.value, "status_code", None) == 503


def test_a_unified_node_given_the_router_as_peer_takes_routed_requests(
    cluster: Cluster, tmp_path: Path
) -> None:
    """It registers, is picked (idle, and its id sorts first; the decode node may be gone by
    now), computes the prompt itself (no handoff) and answers as a unified node asked directly;
    it leaves the router on SIGTERM."""
    port = free_port()
    args = [*cluster.node_args, "--kv-store-dir", str(tmp_path / "store")]
    args += ["--peers", cluster.router.url, "--node-id", "a-unified", "--lease-s", "3"]
    proc = spawn(port, args, tmp_path / "unified.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 120)
        node = Node(f"http://127.0.0.1:{port}", proc)
        _until(lambda: cluster.router.health()["nodes"]["unified"] == 1, what="registered")
        prompt = list(range(1200, 1260))
        assert _complete(cluster.router, False, prompt) == _complete(cluster.unified, False, prompt)
        health = node.health()
        assert (health["prefix_requests"], health["kv_handoff_imported"]) == (1, 0)
    finally:
        _stop(proc)
    _until(lambda: cluster.router.health()["nodes"]["unified"] == 0, what="it left the router")
