"""The comparison loop: one server at a time (they share the cores), systems alternating within
each repeat, every concurrency on each started server, fresh prompts for every run."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.peers import floor, report, venvs, workload
from bench.peers.servers import (
    Launch,
    Server,
    deepinfer_launch,
    llamacpp_launch,
    vllm_launch,
)
from daemon.service.live_server import free_port

WARMUP_OUTPUT_LEN = 16
VARIANT_OF = "deepinfer"  # the system a variant "deepinfer:LABEL" runs with more flags


@dataclass
class Plan:
    systems: list[str]
    model: Path | None  # HF checkpoint directory: deepinfer, vLLM
    gguf: Path | None  # llama.cpp
    dtype: str
    concurrency: list[int]
    num_prompts: list[int]  # requests of each concurrency's runs
    repeats: int
    work: workload.Workload
    out: Path
    seed: int = 0
    warmup: int = 4  # requests before the timed runs of each started server
    ready_timeout_s: float = 900.0
    peers_root: Path | None = None
    extra_args: dict[str, str] = field(default_factory=dict)  # system -> its server's flags
    kv_store: bool = True  # deepinfer's block store on (as by default), a fresh one per server
    # label -> more flags for deepinfer, run as system "deepinfer:LABEL" after the others
    variants: dict[str, str] = field(default_factory=dict)

    def served_dtype(self, system: str) -> str:
        """The dtype `system` serves in: a variant's last --dtype, else the plan's."""
        flags = shlex.split(self.variants.get(system.partition(":")[2], ""))
        dtype = self.dtype
        for flag, value in zip(flags, flags[1:] + [""]):
            if flag == "--dtype" and value:
                dtype = value
            elif flag.startswith("--dtype="):
                dtype = flag.split("=", 1)[1]
        return dtype


def file_stem(system: str) -> str:
    """`system` as a file name's start ("deepinfer:fp32" -> "deepinfer-fp32")."""
    return system.replace(":", "-")


def launch(plan: Plan, system: str, port: int, rep: int = 0) -> Launch:
    base, _, label = system.partition(":")
    extra = shlex.split(plan.extra_args.get(base, ""))
    if base == VARIANT_OF:
        assert plan.model is not None
        extra += shlex.split(plan.variants[label]) if label else []
        # every server its own store: a variant's would turn the prompts into prefix hits
        name = f"kv-store-{label}-r{rep}" if label else f"kv-store-r{rep}"
        store = plan.out / name if plan.kv_store else None
        return deepinfer_launch(plan.model, port, plan.dtype, extra, store)
    if system == "vllm":
        assert plan.model is not None
        env = venvs.ensure("vllm", plan.peers_root)
        return vllm_launch(env, plan.model, port, plan.dtype, extra)
    assert plan.gguf is not None
    return llamacpp_launch(venvs.ensure("llamacpp", plan.peers_root), plan.gguf, port, extra)


def run(plan: Plan) -> dict[str, Any]:
    """Every run's summary, the table's rows; writes peers.json and table.md under plan.out."""
    plan.out.mkdir(parents=True, exist_ok=True)
    # before any server: the copy rate of this machine with its cores to itself
    weights = floor.measure(
        plan.model, plan.gguf if "llamacpp" in plan.systems else None, plan.dtype
    )
    print(report.describe_floor(weights), flush=True)
    runs: list[dict[str, Any]] = []
    started: list[dict[str, Any]] = []
    for rep in range(plan.repeats):
        for system in plan.systems:
            port = free_port()
            spec = launch(plan, system, port, rep)
            with Server(spec, port, plan.out / f"{file_stem(system)}-r{rep}.log") as server:
                ready_s = server.wait_ready(plan.ready_timeout_s)
                started.append(
                    {"system": system, "repeat": rep, "ready_s": ready_s, "pid": server.proc.pid}
                )
                print(f"[{system} r{rep}] ready in {ready_s:.1f} s: {server.base_url}", flush=True)
                base = plan.seed + 1000 * rep  # same prompts for every system, fresh per run
                if plan.warmup:
                    _warm_up(plan, system, spec.served_name, server.base_url, base + 999)
                for i, (conc, n) in enumerate(zip(plan.concurrency, plan.num_prompts)):
                    path = plan.out / f"{file_stem(system)}-r{rep}-c{conc}.json"
                    work = replace(plan.work, num_prompts=n)
                    args = workload.serve_args(
                        system, work, server.base_url, spec.served_name, conc, base + i, path
                    )
                    data = workload.run(args)
                    runs.append(
                        {
                            "system": system,
                            "concurrency": conc,
                            "repeat": rep,
                            "result_json": str(path),
                            "summary": data["summary"],
                        }
                    )
    dtypes = {s: plan.served_dtype(s) for s in plan.systems}
    rows = report.rows(runs, weights, plan.dtype, dtypes)
    result = {
        "plan": asdict(plan),
        "floor": weights.to_json() if weights is not None else None,
        "started": started,
        "runs": runs,
        "rows": [asdict(r) for r in rows],
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    (plan.out / "peers.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (plan.out / "table.md").write_text(report.markdown(rows, weights) + "\n")
    return result


def _warm_up(plan: Plan, system: str, model: str, url: str, seed: int) -> None:
    """Not timed: first-request costs (graph capture, allocator growth, page faults) out."""
    w = workload.Workload(
        plan.warmup, plan.work.input_len, WARMUP_OUTPUT_LEN, plan.work.tokenizer, plan.work.extra
    )
    path = plan.out / f"{file_stem(system)}-warmup.json"
    # llama-cpp-python's server runs one request at a time and cuts concurrent streams short
    conc = 1 if system == "llamacpp" else plan.warmup
    workload.run(workload.serve_args(system, w, url, model, conc, seed, path))
