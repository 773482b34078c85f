"""Issue 23: a traffic shift (prefill-heavy, decode-heavy, prefill-heavy) on a router and 4
daemons (2 prefill + 2 decode to start), with and without `--autoscale`: SLO attainment (TTFT
and TPOT within their targets, measured by the client), failed requests, node-seconds by role
(polled from the router every second) and the router's decisions (its /metrics and log).
The nodes run eager (no compiled decode forward): four of them compiling at once on a small
machine take minutes to start, and the roles, not the kernels, are under test.

`--node-cpus C` gives each daemon a CPU quota of its own (a cgroup; root): on one small
machine an idle node's cores would otherwise go to the busy ones, so moving a node would add
no capacity; with a quota each node is as a machine of C cores.

    python -m bench.autoscale [--node-cpus 0.4 --phase-s 40 --rate-prefill 2 --rate-decode 4
        --json F] [--sim-table T.json]  # the same shift in the simulator (bench/autoscale_sim.py)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.common import ModelSpec, make_checkpoint, percentile
from bench.cpu_quota import CpuQuota
from daemon.service.live_server import free_port
from daemon.sim.table import Bandwidth, CostTable, Grid

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-autoscale-token"
NAME = "tiny"
ROLES = ("prefill", "prefill", "decode", "decode")


@dataclass
class Sample:
    phase: int
    sent_s: float  # from the first request
    ttft_s: float | None = None  # None: failed
    tpot_s: float | None = None


@dataclass
class Result:
    samples: list[Sample] = field(default_factory=list)
    node_seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    roles: list[tuple[float, dict[str, str]]] = field(default_factory=list)  # (s, node -> role)
    cpu: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (s, node -> CPU s)
    metrics: list[str] = field(default_factory=list)


def checkout_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return os.environ | {"DEEPINFER_SERVER_ADMIN_TOKEN": TOKEN, "PYTHONPATH": path}


def spawn(port: int, args: list[str], log: Path, quota: CpuQuota | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "daemon", "serve", "--port", str(port), *args]
    with log.open("wb") as f:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=checkout_env(), stdout=f, stderr=subprocess.STDOUT,
            preexec_fn=quota.join if quota else None,
        )  # fmt: skip


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


async def one(http: aiohttp.ClientSession, router: str, prompt: int, out: int, s: Sample) -> None:
    # a prompt of its own (no prefix-cache hit): seeded by the send time
    rng = random.Random(s.sent_s)
    body = {
        "model": NAME, "prompt": [rng.randrange(10, 4000) for _ in range(prompt)], "max_tokens": out,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    start = time.monotonic()
    first = last = None
    tokens = 0
    try:
        async with http.post(router + "/v1/completions", json=body) as r:
            if r.status != 200:
                return
            async for line in r.content:
                if line.startswith(b"data: {"):
                    if b'"error"' in line:
                        return
                    now = time.monotonic()
                    first = first or now
                    last, tokens = now, tokens + 1
    except (aiohttp.ClientError, TimeoutError):
        return
    if first is None or last is None or tokens < out:
        return
    s.ttft_s = first - start
    s.tpot_s = (last - first) / (tokens - 1) if tokens > 1 else 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def poll_roles(
    http: aiohttp.ClientSession, router: str, res: Result, t0: float, pids: dict[str, int]
) -> None:
    while True:
        res.cpu.append(
            (round(time.monotonic() - t0, 1), {n: cpu_seconds(p) for n, p in pids.items()})
        )
        try:
            async with http.get(router + "/cluster/v1/nodes") as r:
                nodes = (await r.json())["data"]
            for n in nodes:
                if n["role"] in res.node_seconds:
                    res.node_seconds[n["role"]] += 1.0
            roles = {n["node_id"]: n["role"] for n in nodes}
            if not res.roles or res.roles[-1][1] != roles:
                res.roles.append((round(time.monotonic() - t0, 1), roles))
        except (aiohttp.ClientError, OSError, ValueError, KeyError):
            pass
        await asyncio.sleep(1.0)


async def drive(router: str, args, pids: dict[str, int]) -> Result:
    res = Result()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await wait_nodes(http, router, 4, 600)
        t0 = time.monotonic()
        poller = asyncio.create_task(poll_roles(http, router, res, t0, pids))
        tasks = []
        for k, (rate, prompt, out) in enumerate(phases(args)):
            for i in range(int(args.phase_s * rate)):
                # on a fixed schedule: a slow client loop does not thin the load
                delay = t0 + k * args.phase_s + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                s = Sample(k, time.monotonic() - t0)
                res.samples.append(s)
                tasks.append(asyncio.create_task(one(http, router, prompt, out, s)))
        await asyncio.gather(*tasks)
        poller.cancel()
        async with http.get(router + "/metrics") as r:
            res.metrics = [
                line for line in (await r.text()).splitlines() if "autoscale_" in line
                and not line.startswith("#")
            ]  # fmt: skip
    return res


def node_args(model: Path, role: str, i: int, router: str, args) -> list[str]:
    return [
        "--model", str(model), "--served-model-name", NAME, "--role", role,
        "--node-id", f"n{i}", "--peers", router, "--kv-cache-memory-gb", str(args.kv_gb),
        "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048", "--no-kv-store",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        # a decode node computes the short prompts itself (no handoff), as a deployment would
        "--handoff-min-tokens", str(args.handoff_min_tokens),
        "--cpu-threads", "1", "--log-format", "json", "--enforce-eager",
        "--lease-s", str(args.lease_s),
    ]  # fmt: skip


def run(args, model: Path, tmp: Path, autoscale: bool, k: int) -> dict:
    """Arm `k` (its logs: router-K-ARM.log, nI-K-ARM.log)."""
    ports = [free_port() for _ in range(5)]
    router = f"http://127.0.0.1:{ports[0]}"
    scale = ["--autoscale", "--autoscale-window-s", str(args.window_s),
             "--autoscale-ttft-p99-s", str(args.ttft_s), "--autoscale-tpot-p99-s", str(args.tpot_s),
             "--autoscale-node-dwell-s", str(args.node_dwell_s),
             "--autoscale-global-dwell-s", str(args.global_dwell_s),
             "--autoscale-queue-per-node", str(args.queue_per_node)] if autoscale else []  # fmt: skip
    kind = "autoscale" if autoscale else "fixed"
    arm = f"{k}-{kind}"
    router_args = ["--role", "router", "--log-format", "json", "--lease-s", str(args.lease_s)]
    procs = [spawn(ports[0], [*router_args, *scale],
                   tmp / f"router-{arm}.log")]  # fmt: skip
    quotas: list[CpuQuota | None] = [
        CpuQuota(f"bench-autoscale-n{i}", args.node_cpus) if args.node_cpus else None
        for i in range(1, 5)
    ]
    for i, role in enumerate(ROLES, 1):
        procs.append(
            spawn(ports[i], node_args(model, role, i, router, args),
                  tmp / f"n{i}-{arm}.log", quotas[i - 1])
        )  # fmt: skip
    load = os.getloadavg()[0]
    try:
        pids = {f"n{i}": p.pid for i, p in enumerate(procs[1:], 1)}
        res = asyncio.run(drive(router, args, pids))
        load = max(load, os.getloadavg()[0])
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        throttled = [round(q.throttled_s(), 1) for q in quotas if q]
        for q in quotas:
            if q:
                q.remove()
    log = (tmp / f"router-{arm}.log").read_text().splitlines()
    events = [json.loads(line) for line in log if '"autoscale_' in line]
    return {
        "arm": kind,
        "load_1m_at_end": round(load, 2),
        **summary(res.samples, args),
        "by_phase": [
            summary([s for s in res.samples if s.phase == k], args)
            for k in range(len(phases(args)))
        ],
        "node_seconds": res.node_seconds,
        "roles": res.roles,
        "cpu_share_by_phase": cpu_shares(res.cpu, args),
        "throttled_s": throttled,
        "moves": [e for e in events if e.get("event") == "autoscale_moved"],
        "failed_moves": [e for e in events if e.get("event") == "autoscale_move_failed"],
        "decisions": [e for e in events if e.get("event") == "autoscale_decision"],
        "metrics": res.metrics,
    }


def profile_table(args, model: Path, tmp: Path) -> Path:
    """`deepinfer profile` of the bench's model on one torch thread, as a node of
    `--node-cpus` cores runs it: profiled on a whole core, every step then slowed by 1 / C.
    Profiled in the quota instead, short steps would run before the quota throttles them and
    long ones after, each at another speed."""
    out = tmp / "table.json"
    cmd = [sys.executable, "-m", "daemon", "profile", "--model", str(model), "--cpu-threads", "1",
           "--enforce-eager", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=checkout_env(), check=True)
    if args.node_cpus:
        on_cores(CostTable.load(out), args.node_cpus).save(out)
    return out


def on_cores(table: CostTable, cores: float) -> CostTable:
    """`table` (measured on one core) for a node given `cores` of CPU time: every step and
    host copy takes 1 / cores as long."""

    def slower(g: Grid | None) -> Grid | None:
        if g is None:
            return None
        return Grid(g.rows, g.columns, [[s / cores for s in row] for row in g.seconds])

    def narrower(b: Bandwidth) -> Bandwidth:
        return Bandwidth(b.bytes_per_s * cores, b.latency_s / cores)

    note = f"{table.provenance.note}; every time / {cores:g} (a node of {cores:g} cores)"
    return dataclasses.replace(
        table,
        provenance=dataclasses.replace(table.provenance, note=note),
        prefill=slower(table.prefill),
        decode=slower(table.decode),
        prefill_batch=slower(table.prefill_batch),
        host_save=narrower(table.host_save),
        host_load=narrower(table.host_load),
    )


def summary(samples: list[Sample], args) -> dict:
    done = [s for s in samples if s.ttft_s is not None]
    ttft = [s.ttft_s for s in done if s.ttft_s is not None]
    tpot = [s.tpot_s for s in done if s.tpot_s is not None]
    met = sum(1 for s in done if (s.ttft_s or 0) <= args.ttft_s and (s.tpot_s or 0) <= args.tpot_s)
    return {
        "requests": len(samples),
        "finished": len(done),
        "failed": len(samples) - len(done),
        "slo_attainment": met / max(len(samples), 1),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
    }


def cpu_shares(cpu: list[tuple[float, dict[str, float]]], args) -> list[dict[str, float]]:
    """Each node's CPU time in each phase over what its quota (or one core) allowed: 1.0 is a
    node that was busy for the whole phase, whatever its role."""
    cores = args.node_cpus or 1.0
    out = []
    for k in range(len(phases(args))):
        inside = [(t, c) for t, c in cpu if k * args.phase_s <= t <= (k + 1) * args.phase_s]
        if len(inside) < 2:
            out.append({})
            continue
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        out.append({n: round((c1[n] - c0[n]) / (t1 - t0) / cores, 2) for n in c0})
    return out


def phases(args) -> list[tuple[float, int, int]]:
    """(rate, prompt tokens, output tokens) of each phase."""
    return [
        (args.rate_prefill, args.long_prompt, args.short_output),
        (args.rate_decode, args.short_prompt, args.long_output),
        (args.rate_prefill, args.long_prompt, args.short_output),
    ]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=40)
    p.add_argument("--rate-prefill", type=float, default=2.0, help="requests/s, long prompts")
    p.add_argument("--rate-decode", type=float, default=4.0, help="requests/s, long outputs")
    p.add_argument("--long-prompt", type=int, default=1536)
    p.add_argument("--short-prompt", type=int, default=16)
    p.add_argument("--long-output", type=int, default=128)
    # a few tokens: one gap's TPOT (the first decode step after a KV import) is too noisy
    p.add_argument("--short-output", type=int, default=8)
    p.add_argument("--ttft-s", type=float, default=2.0)
    p.add_argument("--tpot-s", type=float, default=0.1)
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--node-dwell-s", type=float, default=10.0)
    p.add_argument("--global-dwell-s", type=float, default=5.0)
    p.add_argument(
        "--queue-per-node", type=float, default=8.0,
        help="requests queued a node counted as at target (the router's --autoscale-queue-per-node)",
    )  # fmt: skip
    p.add_argument("--node-cpus", type=float, default=0.0, help="a CPU quota per node (0: none)")
    p.add_argument("--kv-gb", type=float, default=0.05, help="KV memory per node")
    # a node starved of CPU by a loaded machine still keeps its lease (heartbeats every third)
    p.add_argument("--lease-s", type=float, default=15.0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--handoff-min-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument(
        "--arms", nargs="*", default=["fixed", "autoscale"], choices=["fixed", "autoscale"]
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--sim-table", type=Path, help="a `deepinfer profile` table: simulate too")
    p.add_argument(
        "--sim-request-ms", type=float, default=0.0,
        help="the simulated nodes' HTTP front per request leg (tokenizing, the handoff's calls), "
        "which the profiled table leaves out",
    )  # fmt: skip
    p.add_argument(
        "--sim-request-ms-per-token", type=float, default=0.0,
        help="and per prompt token of the leg that takes a request in",
    )  # fmt: skip
    p.add_argument(
        "--sim-stream-ms-per-token", type=float, default=0.0,
        help="and per output token a decode node streams (detokenizing, the event's write)",
    )  # fmt: skip
    p.add_argument(
        "--sim-profile", action="store_true",
        help="profile the bench's model as a node runs it (its quota), then simulate with that",
    )  # fmt: skip
    return p


def main() -> None:
    args = parser().parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the daemons are stopped too
    tmp = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    heads = max(args.hidden // 64, 1)
    spec = ModelSpec(
        num_layers=args.layers, hidden=args.hidden, heads=heads, kv_heads=max(heads // 2, 1),
        intermediate=3 * args.hidden, vocab=4096, max_positions=8192,
    )  # fmt: skip
    model = make_checkpoint(spec, tmp / "model")
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for k, arm in enumerate(args.arms, 1):
        r = run(args, model, tmp, arm == "autoscale", k)
        out["runs"].append(r)
        if args.json:  # each arm as it ends: a run stopped early keeps what it measured
            args.json.write_text(json.dumps(out, indent=2))
        phase = " | ".join(
            f"{100 * b['slo_attainment']:.0f} % (TTFT p99 {b['ttft_p99_s']:.2f}, "
            f"TPOT p99 {b['tpot_p99_s']:.3f})"
            for b in r["by_phase"]
        )
        print(
            f"{arm}: {r['finished']} done, {r['failed']} failed, SLO attainment "
            f"{100 * r['slo_attainment']:.1f} % [{phase}], node-seconds {r['node_seconds']}, "
            f"moves {[(m['node_id'], m['role']) for m in r['moves']]}, load {r['load_1m_at_end']}, "
            f"CPU share by phase {r['cpu_share_by_phase']}"
        )
    table = args.sim_table
    if args.sim_profile:
        table = profile_table(args, model, tmp)
    if table:
        from bench.autoscale_sim import shift

        out["sim"] = shift(args, table)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(f"logs in {tmp}")


if __name__ == "__main__":
    main()
