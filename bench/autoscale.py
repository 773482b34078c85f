"""Issue 23: a traffic shift (prefill-heavy, decode-heavy, prefill-heavy) on a router and 4
daemons (2 prefill + 2 decode to start), with and without `--autoscale`: SLO attainment (TTFT
and TPOT within their targets, measured by the client), failed requests, node-seconds by role
(polled from the router every second) and the router's decisions (its /metrics and log).
The nodes run eager (no compiled decode forward): four of them compiling at once on a small
machine take minutes to start, and the roles, not the kernels, are under test.

    python -m bench.autoscale [--phase-s 40 --rate-prefill 2 --rate-decode 4 --json F]
        [--sim-table T.json]  # the same shift in the simulator (daemon/sim/pd.py), same policy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.common import ModelSpec, make_checkpoint, percentile
from daemon.service.live_server import free_port

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-autoscale-token"
NAME = "tiny"


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    met: int = 0
    failed: int = 0
    node_seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})


def spawn(port: int, args: list[str], log: Path) -> subprocess.Popen:
    env = os.environ | {
        "DEEPINFER_SERVER_ADMIN_TOKEN": TOKEN,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [sys.executable, "-m", "daemon", "serve", "--port", str(port), *args]
    with log.open("wb") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


async def wait_nodes(http: aiohttp.ClientSession, router: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with http.get(router + "/cluster/v1/nodes") as r:
                if len((await r.json())["data"]) == n:
                    return
        except (aiohttp.ClientError, OSError):
            pass
        await asyncio.sleep(0.5)
    raise SystemExit("the nodes did not register")


async def one(http: aiohttp.ClientSession, router: str, prompt: int, out: int, args, res: Result):
    body = {
        "model": NAME, "prompt": list(range(100, 100 + prompt)), "max_tokens": out,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    start = time.monotonic()
    first = last = None
    tokens = 0
    try:
        async with http.post(router + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.failed += 1
                return
            async for line in r.content:
                if line.startswith(b"data: {"):
                    if b'"error"' in line:
                        res.failed += 1
                        return
                    now = time.monotonic()
                    first = first or now
                    last, tokens = now, tokens + 1
    except (aiohttp.ClientError, TimeoutError):
        res.failed += 1
        return
    if first is None or tokens < out:
        res.failed += 1
        return
    ttft = first - start
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    res.ttft.append(ttft)
    res.tpot.append(tpot)
    res.met += ttft <= args.ttft_s and tpot <= args.tpot_s


async def poll_roles(http: aiohttp.ClientSession, router: str, res: Result) -> None:
    while True:
        try:
            async with http.get(router + "/cluster/v1/nodes") as r:
                for n in (await r.json())["data"]:
                    if n["role"] in res.node_seconds:
                        res.node_seconds[n["role"]] += 1.0
        except (aiohttp.ClientError, OSError, ValueError):
            pass
        await asyncio.sleep(1.0)


async def drive(router: str, args) -> Result:
    res = Result()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await wait_nodes(http, router, 4, 600)
        poller = asyncio.create_task(poll_roles(http, router, res))
        tasks = []
        for rate, prompt, out in phases(args):
            for _ in range(int(args.phase_s * rate)):
                tasks.append(asyncio.create_task(one(http, router, prompt, out, args, res)))
                await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
        poller.cancel()
        async with http.get(router + "/metrics") as r:
            res.metrics = [  # type: ignore[attr-defined]
                line for line in (await r.text()).splitlines() if "autoscale_" in line
                and not line.startswith("#")
            ]  # fmt: skip
    return res


def run(args, model: Path, tmp: Path, autoscale: bool) -> dict:
    ports = [free_port() for _ in range(5)]
    router = f"http://127.0.0.1:{ports[0]}"
    scale = ["--autoscale", "--autoscale-window-s", str(args.window_s),
             "--autoscale-ttft-p99-s", str(args.ttft_s), "--autoscale-tpot-p99-s", str(args.tpot_s),
             "--autoscale-node-dwell-s", str(args.window_s * 2),
             "--autoscale-global-dwell-s", str(args.window_s)] if autoscale else []  # fmt: skip
    procs = [spawn(ports[0], ["--role", "router", "--log-format", "json", *scale],
                   tmp / f"router-{autoscale}.log")]  # fmt: skip
    for i, role in enumerate(["prefill", "prefill", "decode", "decode"], 1):
        node = [
            "--model", str(model), "--served-model-name", NAME, "--role", role,
            "--node-id", f"n{i}", "--peers", router, "--kv-cache-memory-gb", "0.05",
            "--max-num-seqs", "16", "--max-model-len", "2048", "--no-kv-store",
            "--cpu-threads", "1", "--log-format", "json", "--enforce-eager",
        ]  # fmt: skip
        procs.append(spawn(ports[i], node, tmp / f"n{i}-{autoscale}.log"))
    try:
        res = asyncio.run(drive(router, args))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    done = len(res.ttft)
    decisions = [
        json.loads(line)
        for line in (tmp / f"router-{autoscale}.log").read_text().splitlines()
        if '"autoscale_decision"' in line or '"autoscale_moved"' in line
    ]
    return {
        "autoscale": autoscale,
        "finished": done,
        "failed": res.failed,
        "slo_attainment": res.met / max(done + res.failed, 1),
        "ttft_p50_s": percentile(res.ttft, 50) if done else None,
        "ttft_p99_s": percentile(res.ttft, 99) if done else None,
        "tpot_p50_s": percentile(res.tpot, 50) if done else None,
        "tpot_p99_s": percentile(res.tpot, 99) if done else None,
        "node_seconds": res.node_seconds,
        "moves": [d for d in decisions if d.get("event") == "autoscale_moved"],
        "decisions": [d for d in decisions if d.get("event") == "autoscale_decision"],
        "metrics": getattr(res, "metrics", []),
    }


def phases(args) -> list[tuple[float, int, int]]:
    """(rate, prompt tokens, output tokens) of each phase."""
    return [
        (args.rate_prefill, args.long_prompt, 2),
        (args.rate_decode, 16, args.long_output),
        (args.rate_prefill, args.long_prompt, 2),
    ]


def simulated(args) -> list[dict]:
    """The shift through the simulator's P/D cluster (2 + 2 nodes), fixed and autoscaled."""
    from daemon.cluster.autoscale import Targets
    from daemon.sim.node import NodeConfig
    from daemon.sim.pd import PDConfig, simulate_pd, summarize_pd
    from daemon.sim.table import CostTable
    from daemon.sim.trace import TraceRequest

    trace, ids = [], iter(range(1 << 30))
    for k, (rate, prompt, out) in enumerate(phases(args)):
        for i in range(int(args.phase_s * rate)):
            blocks = tuple(next(ids) for _ in range(-(-prompt // 512)))
            trace.append(TraceRequest(k * args.phase_s + i / rate, prompt, out, blocks))
    targets = Targets(
        ttft_p99_s=args.ttft_s, tpot_p99_s=args.tpot_s,
        node_dwell_s=args.window_s * 2, global_dwell_s=args.window_s,
    )  # fmt: skip
    table = CostTable.load(args.sim_table)
    node = NodeConfig(0.05 * 2**30, 0, 16, 2048)
    runs = []
    for scaled in (False, True):
        cfg = PDConfig(2, 2, node, targets=targets if scaled else None, window_s=args.window_s)
        r = summarize_pd(simulate_pd(table, trace, cfg), targets)
        runs.append(r)
        kinds = [d["kind"] for d in r["decisions"] if d["kind"] != "hold"]
        print(
            f"sim {'autoscale' if scaled else 'fixed'}: SLO attainment "
            f"{100 * r['slo']['attainment']:.1f} %, node-seconds {r['node_seconds']}, "
            f"moves {kinds}"
        )
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=40)
    p.add_argument("--rate-prefill", type=float, default=2.0, help="requests/s, long prompts")
    p.add_argument("--rate-decode", type=float, default=4.0, help="requests/s, long outputs")
    p.add_argument("--long-prompt", type=int, default=1536)
    p.add_argument("--long-output", type=int, default=128)
    p.add_argument("--ttft-s", type=float, default=2.0)
    p.add_argument("--tpot-s", type=float, default=0.1)
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument(
        "--arms", nargs="*", default=["fixed", "autoscale"], choices=["fixed", "autoscale"]
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--sim-table", type=Path, help="a `deepinfer profile` table: simulate too")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    spec = ModelSpec(num_layers=4, hidden=256, heads=4, kv_heads=2, intermediate=768, vocab=4096)
    model = make_checkpoint(spec, tmp / "model")
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for arm in args.arms:
        r = run(args, model, tmp, arm == "autoscale")
        out["runs"].append(r)
        print(
            f"{arm}: {r['finished']} done, {r['failed']} failed, SLO attainment "
            f"{100 * r['slo_attainment']:.1f} %, TTFT p99 {r['ttft_p99_s']}, TPOT p99 "
            f"{r['tpot_p99_s']}, node-seconds {r['node_seconds']}, moves {len(r['moves'])}"
        )
    if args.sim_table:
        out["sim"] = simulated(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(f"logs in {tmp}")


if __name__ == "__main__":
    main()
