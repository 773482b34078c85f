"""Flags of `deepinfer bench serve` (argparse and pure-Python defaults only, so the CLI stays
import-light)."""

from __future__ import annotations

import argparse

from daemon.benchmark.datasets import DEFAULT_VOCAB_SIZE

DEFAULT_NUM_PROMPTS = 200  # random / prefix-sharing, without --num-prompts or --duration
DATASETS = ("random", "prefix-sharing", "chat", "agent", "jsonl")
PROMPT_FORMATS = ("ids", "text")
SLO_KEYS = ("ttft", "tpot", "e2el")


def _slo(value: str) -> tuple[str, float]:
    key, sep, ms = value.partition(":")
    if not sep or key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}"
        )
    try:
        bound = float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: {ms!r} is not a number") from None
    if bound <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: the bound must be positive")
    return key, bound


def _range(value: str) -> tuple[int, int]:
    lo, _, hi = value.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected LO-HI or N") from None
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"{value!r}: expected 0 < LO <= HI")
    return a, b


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root (a trailing /v1 is accepted)",
    )
    t.add_argument("--endpoint", default="/v1/completions", help="OpenAI legacy completions path")
    t.add_argument(
        "--model", default=None, help="model name to send (default: the first of GET /v1/models)"
    )
    t.add_argument(
        "--api-key", default=None, help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)"
    )
    t.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default="ids",
        help="ids: prompts are token ids and multi-turn histories grow by the answer's returned "
        "token ids (`return_token_ids`: deepinfer, vLLM); text: prompts are text decoded with "
        "--tokenizer and histories grow by the answer's text (servers that take text only, "
        "e.g. `transformers serve`)",
    )
    t.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or a directory holding one (default: --model when it is such a "
        "directory); needed for --prompt-format text, else it keeps special tokens out of "
        "random prompts",
    )
    t.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="random token ids are drawn below this (default: the tokenizer's size, else "
        f"{DEFAULT_VOCAB_SIZE})",
    )
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true (deepinfer, vLLM); transformers serve rejects the field",
    )
    t.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    d = p.add_argument_group("workload")
    d.add_argument("--dataset", choices=DATASETS, default="random")
    d.add_argument(
        "--dataset-path",
        default=None,
        help='jsonl: one request per line, {"messages": [...]} (send them to --endpoint '
        '/v1/chat/completions) or {"prompt": TEXT | [IDS]}, with an optional "max_tokens" '
        "(default --output-len); sent in file order, each once",
    )
    d.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests to send (random/prefix-sharing: default {DEFAULT_NUM_PROMPTS}; chat/agent: "
        "caps the trace's turns, the first N by nominal arrival; jsonl: the file's first N)",
    )
    d.add_argument("--input-len", type=int, default=256, help="random: prompt tokens; "
                   "prefix-sharing: tokens after the shared prefix")  # fmt: skip
    d.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    d.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    d.add_argument("--prefix-len", type=int, default=1024, help="prefix-sharing: shared tokens")
    d.add_argument("--num-prefixes", type=int, default=4, help="prefix-sharing: distinct prefixes")
    d.add_argument("--num-sessions", type=int, default=16, help="chat/agent: sessions")
    d.add_argument(
        "--turns", type=_range, default=None, help="chat/agent: turns per session, LO-HI"
    )
    d.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="chat/agent: multiply every token length of the trace (system prompts, tools, "
        "messages, answers), to fit small models",
    )
    d.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="chat/agent: a session ends before its context passes this (default: the trace's)",
    )
    d.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="chat/agent: multiply session start times and think times (0: no waits)",
    )
    d.add_argument("--seed", type=int, default=0)

    ld = p.add_argument_group("load")
    ld.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="random/prefix-sharing: Poisson arrivals per second (default inf: all at once)",
    )
    ld.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ld.add_argument(
        "--duration",
        type=float,
        default=None,
        help="random/prefix-sharing: keep sending fresh requests for this many seconds "
        "(needs --max-concurrency or --request-rate)",
    )

    o = p.add_argument_group("results")
    o.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=None,
        metavar="KEY:MS",
        help="SLOs in ms (ttft, tpot, e2el): goodput = requests meeting all of them per second",
    )
    o.add_argument("--result-json", default=None, help="config, summary and per-request records")
    o.add_argument("--plot", default=None, help="PNG: latency CDFs and tokens/s over time")
    o.add_argument("--label", default=None, help="run name in the report and plot")
    o.add_argument("--disable-tqdm", action="store_true")
