"""Simulator fidelity (issue 22): one workload on real daemons and in `deepinfer simulate`, with
a cost table `deepinfer profile` measured with the daemons' own settings; sim / real ratios of
output throughput, TTFT p50 / p99 and TPOT p50, for a unified node and a prefill + decode pair.

Each repeat, each setup in turn (the order alternating), back to back: `deepinfer profile`
(the table, on a grid around the workload's shapes, each point warmed up); the fixed costs the
table cannot hold, from short requests (8-token prompts, 2 tokens out): a node's per-request
HTTP front (`--request-ms`: the unified node's TTFT less the table's step) and the pair's
handoff legs (`--link-latency-ms`: the pair's TTFT less the front, both steps and the link's
bytes); the real run (`deepinfer bench serve`: random token-id prompts, a fixed client
concurrency, a fresh seed so no prompt is a cache hit); and the simulation of the very requests
it sent (their lengths, the same concurrency bound) on that table and those costs. Medians over
repeats. The daemons stay up through the repeats (started once, warmed up); every model daemon
gets the engine flags the profile gets: `--cpu-threads 1` (a pair's two model nodes on this
machine's two cores) and `--no-overlap` unless `--overlap` (the simulator models both).

    python -m bench.sim_fidelity --repeats 3 --out bench/results/sim-fidelity
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import median, percentile
from bench.peers.servers import ROOT, Launch, Server
from daemon.benchmark.client import RequestRecord as RecordOf
from daemon.benchmark.client import Target, stream_request
from daemon.service.live_server import free_port
from daemon.sim.cluster import ClusterConfig, simulate
from daemon.sim.cost import handoff
from daemon.sim.node import NodeConfig
from daemon.sim.table import Bandwidth, CostTable
from daemon.sim.trace import TRACE_BLOCK, TraceRequest

NAME = "fidelity"
GB = 2**30
METRICS = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s")
SETUPS = ("unified", "pair")


@dataclass(frozen=True)
class Engine:
    """The engine flags every model daemon and the profile run with."""

    threads: int
    kv_gb: float
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    eager: bool
    overlap: bool
    extra: tuple[str, ...] = ()

    def args(self) -> list[str]:
        out = ["--cpu-threads", str(self.threads), "--kv-cache-memory-gb", str(self.kv_gb)]
        out += ["--max-num-seqs", str(self.max_num_seqs), "--block-size", str(self.block_size)]
        out += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        out += ["--host-cache-memory-gb", "0", "--no-kv-store", *self.extra]
        out += ["--overlap"] if self.overlap else ["--no-overlap"]
        return out + (["--enforce-eager"] if self.eager else [])

    def node(self) -> NodeConfig:
        return NodeConfig(self.kv_gb * GB, 0, self.max_num_seqs, self.max_num_batched_tokens)


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"PYTHONPATH": path}


def _daemon(*args: str) -> list[str]:
    return [sys.executable, "-m", "daemon", *args]


def _load() -> float:
    return round(os.getloadavg()[0], 2)


# ---- the real side ---------------------------------------------------------------------------


def _serve(stack: ExitStack, args: list[str], log: Path) -> Server:
    port = free_port()
    argv = _daemon("serve", "--host", "127.0.0.1", "--port", str(port), *args)
    argv += ["--log-format", "json", "--log-level", "warning"]
    launch = Launch("deepinfer", argv, NAME, {"PYTHONPATH": _env()["PYTHONPATH"]})
    return stack.enter_context(Server(launch, port, log))


def start_setups(
    stack: ExitStack, e: Engine, tmp: Path, setups: list[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Each setup's base URL: a unified node, or a router with one prefill and one decode node
    registered to it; and the pair's nodes' own URLs, by role."""
    model = [*e.args(), "--served-model-name", NAME]
    urls: dict[str, str] = {}
    nodes: dict[str, str] = {}
    routers: list[Server] = []
    servers: list[Server] = []
    if "unified" in setups:
        servers.append(_serve(stack, model, tmp / "unified.log"))
        urls["unified"] = servers[-1].base_url
    if "pair" in setups:
        router = _serve(stack, ["--role", "router", "--handoff-timeout-s", "120"], tmp / "r.log")
        routers.append(router)
        for role in ("prefill", "decode"):
            args = [*model, "--role", role, "--peers", router.base_url, "--node-id", role]
            servers.append(
                _serve(stack, [*args, "--handoff-timeout-s", "120"], tmp / f"{role}.log")
            )
            nodes[role] = servers[-1].base_url
        urls["pair"] = router.base_url
    for s in [*routers, *servers]:
        s.wait_ready(900)
    for router in routers:
        deadline = time.monotonic() + 60
        while _health(router.base_url)["nodes"] != {"prefill": 1, "decode": 1, "unified": 0}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes did not register: {_health(router.base_url)}")
            time.sleep(0.5)
    return urls, nodes


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


HANDOFF_COUNTS = ("kv_handoff_exported", "kv_handoff_imported", "kv_handoff_bytes_exported")


def handoff_counters(nodes: dict[str, str]) -> dict[str, float]:
    """The pair's nodes' handoff counters (/health): exports and imports, bytes, and the
    seconds by phase (prefill side: export, which holds the prompt's compute, and send; decode
    side: fetch and import), each key `<role>.<name>`."""
    out: dict[str, float] = {}
    for role, url in nodes.items():
        h = _health(url)
        out |= {f"{role}.{k}": h[k] for k in HANDOFF_COUNTS if k in h}
        for phase, s in h.get("kv_handoff_seconds_by_phase", {}).items():
            out[f"{role}.{phase}_s"] = s
    return out


def handoff_phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the real run's handoffs took, from the counters around it: per handoff, the
    prefill node's send (the HTTP layer's: encode, sha256, write) and the decode node's
    import (queued for the device thread to done), and the send's bytes per second."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    n = d.get("prefill.kv_handoff_exported", 0)
    if not n:
        return d
    send = d.get("prefill.send_s", 0.0)
    d["send_s_per_handoff"] = send / n
    d["import_s_per_handoff"] = d.get("decode.import_s", 0.0) / n
    if send > 0:
        d["send_bytes_per_s"] = d.get("prefill.kv_handoff_bytes_exported", 0) / send
    return d


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int

    def bench(self, url: str, seed: int, out: Path, num_prompts: int | None = None) -> list[str]:
        argv = _daemon("bench", "serve", "--base-url", url, "--model", NAME, "--ignore-eos")
        argv += ["--dataset", "random", "--num-prompts", str(num_prompts or self.num_prompts)]
        argv += ["--input-len", str(self.input_len), "--output-len", str(self.output_len)]
        argv += ["--max-concurrency", str(self.concurrency), "--seed", str(seed)]
        return argv + ["--result-json", str(out), "--disable-tqdm"]


def bench(url: str, w: Workload, seed: int, out: Path, num_prompts: int | None = None) -> dict:
    """`deepinfer bench serve` against `url`: its result file."""
    argv = w.bench(url, seed, out, num_prompts)
    done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return json.loads(out.read_text())


def real_figures(result: dict) -> dict[str, Any]:
    recs = [r for r in result["requests"] if r["ok"]]
    if len(recs) != len(result["requests"]):
        raise RuntimeError(f"{len(result['requests']) - len(recs)} requests failed")
    s = result["summary"]
    return _figures(
        [r["ttft_s"] for r in recs],
        [r["tpot_s"] for r in recs if r["tpot_s"] is not None],
        s["output_throughput"],
    ) | {"duration_s": s["duration_s"], "ttft_by_request": _by_index(recs)}


def _figures(ttft: list[float], tpot: list[float], tok_s: float) -> dict[str, Any]:
    return {
        "output_tok_s": tok_s,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
    }


# ---- the simulated side ----------------------------------------------------------------------


def trace_of(result: dict) -> list[TraceRequest]:
    """The requests the bench sent, as a trace: their prompt and output lengths, each its own
    blocks (random prompts share none), arriving as the bench released them: all at the start
    (--max-concurrency holds the rest, as the simulator's bound does)."""
    out = []
    for i, r in enumerate(sorted(result["requests"], key=lambda r: r["index"])):
        blocks = -(-r["prompt_tokens"] // TRACE_BLOCK)
        ids = tuple(range(i * 1000, i * 1000 + blocks))
        out.append(TraceRequest(0.0, r["prompt_tokens"], r["output_tokens"], ids))
    return out


def sim_figures(
    table: CostTable,
    trace: list[TraceRequest],
    e: Engine,
    w: Workload,
    setup: str,
    link: Bandwidth,
    request_s: float,
) -> dict[str, Any]:
    pair = setup == "pair"
    cfg = ClusterConfig(
        0 if pair else 1, e.node(), 0.0, "least-loaded", 1.0, int(pair), int(pair), link,
        w.concurrency, request_s, e.overlap,
    )  # fmt: skip
    run = simulate(table, trace, cfg, progress=False)
    done = [r for r in run.records if r.finish_s is not None and r.first_token_s is not None]
    if len(done) != len(trace):
        raise RuntimeError(f"the simulation finished {len(done)} of {len(trace)} requests")
    ttft = [r.first_token_s - r.arrival_s for r in done]  # type: ignore[operator]
    tpot = [
        (r.finish_s - r.first_token_s) / (r.output_length - 1)  # type: ignore[operator]
        for r in done
        if r.output_length > 1
    ]
    tok_s = sum(r.output_length for r in done) / run.end_s
    by_request = [
        {"index": r.index, "ttft_s": r.first_token_s - r.arrival_s}  # type: ignore[operator]
        for r in done
    ]
    return _figures(ttft, tpot, tok_s) | {
        "duration_s": run.end_s,
        "wall_s": run.wall_s,
        "ttft_by_request": _by_index(by_request),
    }


def _by_index(recs: list[dict]) -> list[float]:
    """Each request's TTFT in the order the bench numbered them (real and simulated side by
    side: which requests the model gets wrong)."""
    return [round(r["ttft_s"], 4) for r in sorted(recs, key=lambda r: r["index"])]


PROBE_PROMPT, PROBE_OUT, PROBES = 8, 2, 5
LINK_PROBES = 3  # handoffs of the workload's prompt length that measure the link's rate
# loopback HTTP with sha256, measured by bench.pd_disagg handoff on 2026-12-02 (a fallback)
DEFAULT_LINK_BYTES_S = 0.24e9


async def _probe(url: str, tokens: int = PROBE_PROMPT, count: int = PROBES) -> float:
    """The median TTFT of `count` requests of `tokens`-token prompts, one after another."""
    target = Target(url + "/v1/completions", NAME, {}, "ids", 0.0, True, {})
    ttft = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for i in range(count):
            prompt = [1000 + 17 * i + j for j in range(tokens)]  # a fresh prompt each
            rec = await stream_request(
                http, target, prompt, RecordOf(i, PROBE_OUT), time.perf_counter()
            )
            if not rec.ok or rec.ttft_s is None:
                raise RuntimeError(f"a probe request to {url} failed: {rec.error}")
            ttft.append(rec.ttft_s)
    return median(ttft)


def fixed_costs(
    urls: dict[str, str],
    nodes: dict[str, str],
    table: CostTable,
    link_bytes_s: float | None,
    prompt: int,
) -> dict[str, float]:
    """What a short request's TTFT holds beyond the table's steps: the serving node's HTTP
    front (request_s) and, through the router, the handoff's legs (link_latency_s); with no
    `link_bytes_s` given, the link's rate is measured first: the prefill node's send seconds
    (its /health) over LINK_PROBES handoffs of `prompt`-token prompts (link_bytes_per_s)."""
    n = PROBE_PROMPT
    out: dict[str, float] = {}
    if "unified" in urls:
        out["unified_ttft_s"] = asyncio.run(_probe(urls["unified"]))
        out["request_s"] = max(out["unified_ttft_s"] - table.prefill.at(n, 0), 0.0)
    if "pair" in urls:
        if link_bytes_s is None:
            before = handoff_counters(nodes)
            asyncio.run(_probe(urls["pair"], prompt, LINK_PROBES))
            sent = handoff_phases(before, handoff_counters(nodes))
            link_bytes_s = sent.get("send_bytes_per_s", DEFAULT_LINK_BYTES_S)
        out["link_bytes_per_s"] = link_bytes_s
        out["pair_ttft_s"] = asyncio.run(_probe(urls["pair"]))
        # the prefill step, the export's run, the bytes on the link, the import's run, the
        # decode node's step of the last prompt token
        nbytes, export_s, import_s = handoff(table, n - 1)
        steps = table.prefill.at(n - 1, 0) + table.decode.at(1, n - 1) + export_s + import_s
        rest = out["pair_ttft_s"] - out.get("request_s", 0.0) - steps - nbytes / link_bytes_s
        out["link_latency_s"] = max(rest, 0.0)
    return out


# ---- profile, repeats, report ----------------------------------------------------------------


def profile(e: Engine, w: Workload, out: Path, note: str) -> CostTable:
    """The table on a grid around the workload: its prompts (and the steps that hold several),
    its decode batches and contexts."""
    argv = _daemon("profile", "--out", str(out), *e.args(), "--log-level", "warning")
    tokens = sorted({32, w.input_len, min(2 * w.input_len, e.max_num_batched_tokens)})
    seqs = sorted({1, max(w.concurrency // 2, 1), w.concurrency, 2 * w.concurrency})
    # every prompt is one chunk at context 0; each point warmed up, then timed (a cold first
    # run of a multi-second chunk is not its time)
    argv += ["--prefill-tokens", ",".join(map(str, tokens)), "--prefill-context", "0"]
    argv += ["--point-seconds", "8"]
    argv += ["--decode-seqs", ",".join(map(str, seqs))]
    # steps of as many chunks as the clients send at once: a step's once-paid part and each
    # chunk's own (the sizes of `tokens` whose steps fit the token budget)
    argv += ["--prefill-batch", f"1,{max(w.concurrency, 2)}"]
    argv += ["--decode-context", f"{w.input_len},{w.input_len + w.output_len}"]
    argv += ["--note", note]
    done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"profile failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return CostTable.load(out)


def one(
    a: argparse.Namespace,
    e: Engine,
    w: Workload,
    urls: dict[str, str],
    nodes: dict[str, str],
    name: str,
    r: int,
    out: Path,
) -> dict[str, Any]:
    """One setup's turn, back to back: the table, the fixed costs, the real run, the
    simulation of its requests."""
    load = {"before_profile": _load()}
    t0 = time.time()
    table = (
        CostTable.load(a.table)
        if a.table
        else profile(e, w, out / f"table-{r}-{name}.json", f"sim_fidelity repeat {r} {name}")
    )
    load["after_profile"] = _load()
    profile_s = time.time() - t0
    given = a.link_gb_s * 1e9 if a.link_gb_s is not None else None
    costs = fixed_costs(urls, nodes, table, given, w.input_len)
    request_s = costs.get("request_s", 0.0) if a.request_ms is None else a.request_ms / 1e3
    latency = costs.get("link_latency_s", 0.0)
    if a.link_latency_ms is not None:
        latency = a.link_latency_ms / 1e3
    link = Bandwidth(costs.get("link_bytes_per_s", given or DEFAULT_LINK_BYTES_S), latency)
    load["before_bench"] = _load()
    counters = handoff_counters(nodes) if name == "pair" else {}
    result = bench(urls[name], w, 100 * r + 1, out / f"bench-{name}-{r}.json")
    load["after"] = _load()
    handoffs = handoff_phases(counters, handoff_counters(nodes)) if name == "pair" else {}
    real = real_figures(result)
    sim = sim_figures(table, trace_of(result), e, w, name, link, request_s)
    return {
        "real": real,
        "sim": sim,
        "ratio": {m: sim[m] / real[m] for m in METRICS},
        "profile_s": profile_s,
        "fixed_costs": costs,
        "request_s": request_s,
        "link": {"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s},
        "handoffs": handoffs,
        "load": load,
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    e = Engine(
        a.threads, a.kv_gb, a.max_num_seqs, a.max_num_batched_tokens, a.block_size, a.eager,
        a.overlap, tuple(a.server_args),
    )  # fmt: skip
    w = Workload(a.num_prompts, a.input_len, a.output_len, a.concurrency)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    repeats: list[dict[str, Any]] = []
    with ExitStack() as stack:
        urls, nodes = start_setups(stack, e, out / "logs", a.setups)
        for i, (name, url) in enumerate(urls.items()):  # first allocations, not counted
            bench(url, w, 10_000 + i, out / f"warmup-{name}.json", 2 * w.concurrency)
        for r in range(a.repeats):
            rep: dict[str, Any] = {"repeat": r, "setups": {}}
            for name in a.setups if r % 2 == 0 else a.setups[::-1]:
                rep["setups"][name] = one(a, e, w, urls, nodes, name, r, out)
                print(f"repeat {r} {name}: " + _line(rep["setups"][name]["ratio"]), flush=True)
            repeats.append(rep)
    return {
        "engine": vars(e) | {"args": e.args()},
        "workload": vars(w),
        "command": " ".join(sys.argv),
        "repeats": repeats,
        "median": _medians(repeats),
    }


def _medians(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    names = [n for n in SETUPS if any(n in x["setups"] for x in repeats)]
    return {
        name: {
            side: {
                m: median([x["setups"][name][side][m] for x in repeats if name in x["setups"]])
                for m in METRICS
            }
            for side in ("real", "sim", "ratio")
        }
        for name in names
    }


def resimulate(out: Path) -> dict[str, Any]:
    """The simulated side again, with this checkout's simulator, from a run's files: each
    turn's table, fixed costs and the requests its bench sent (the real side as measured)."""
    result = json.loads((out / "fidelity.json").read_text())
    e = Engine(**{k: v for k, v in result["engine"].items() if k != "args"})
    w = Workload(**result["workload"])
    for rep in result["repeats"]:
        r = rep["repeat"]
        for name, turn in rep["setups"].items():
            table = CostTable.load(out / f"table-{r}-{name}.json")
            bench_result = json.loads((out / f"bench-{name}-{r}.json").read_text())
            link = Bandwidth(turn["link"]["bytes_per_s"], turn["link"]["latency_s"])
            sim = sim_figures(table, trace_of(bench_result), e, w, name, link, turn["request_s"])
            turn["sim"] = sim
            turn["real"]["ttft_by_request"] = _by_index(bench_result["requests"])
            turn["ratio"] = {m: sim[m] / turn["real"][m] for m in METRICS}
    result["median"] = _medians(result["repeats"])
    result["resimulated"] = " ".join(sys.argv)
    return result


def _line(ratio: dict[str, float]) -> str:
    return ", ".join(f"{m} {ratio[m]:.3f}" for m in METRICS)


def report(result: dict[str, Any]) -> str:
    lines = [
        "| setup | figure | real (median) | simulated | sim / real (median of repeats) |",
        "|---|---|---:|---:|---:|",
    ]
    for name, s in result["median"].items():
        for m in METRICS:
            lines.append(
                f"| {name} | {m} | {s['real'][m]:.4g} | {s['sim'][m]:.4g} | {s['ratio'][m]:.3f} |"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(result["median"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [x + i * width for x in range(len(METRICS))]
        ax.bar(xs, [result["median"][name]["ratio"][m] for m in METRICS], width, label=name)
        for rep in result["repeats"]:  # each repeat's ratio as a dot
            ys = [rep["setups"][name]["ratio"][m] for m in METRICS]
            ax.plot(xs, ys, "k.", markersize=4)
    ax.axhspan(0.9, 1.1, color="green", alpha=0.12, label="within 10 %")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(METRICS))], METRICS)
    ax.set_ylabel("simulated / real")
    ax.set_title("deepinfer simulate vs real daemons (median; dots: repeats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="a directory: fidelity.json, .png, tables, logs")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--table", help="a cost table to use instead of profiling each repeat")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="--cpu-threads of every model daemon")
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="--enforce-eager on every model daemon")
    p.add_argument("--overlap", action="store_true", help="--overlap on every model daemon")
    p.add_argument(
        "--link-gb-s",
        type=float,
        default=None,
        help="the pair's KV handoff bandwidth (default: measured each turn, the prefill "
        "node's send seconds over 3 handoffs of the workload's prompt length)",
    )
    p.add_argument(
        "--link-latency-ms", type=float, default=None, help="per handoff (default: measured)"
    )
    p.add_argument(
        "--request-ms", type=float, default=None, help="HTTP front per request (default: measured)"
    )
    p.add_argument(
        "--resimulate",
        action="store_true",
        help="measure nothing: simulate --out's recorded runs again (after a model change)",
    )
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more engine flags")
    a = p.parse_args(argv)
    out = Path(a.out)
    result = resimulate(out) if a.resimulate else run(a)
    (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "fidelity.png")
    print(report(result))
    print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.png'}")


if __name__ == "__main__":
    main()
