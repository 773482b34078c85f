"""One `deepinfer bench serve` run (daemon/benchmark, as is) against a started server, per system
as it takes requests: token-id prompts for deepinfer and vLLM, text for llama.cpp's server."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.benchmark.options import add_serve_arguments
from daemon.benchmark.serve import main as bench_serve


class WorkloadError(Exception):
    """The run completed no request (or the test request failed)."""


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    tokenizer: Path  # the checkpoint's: random prompts avoid its special tokens
    extra: tuple[str, ...] = ()  # more `bench serve` flags


def serve_args(
    system: str,
    w: Workload,
    base_url: str,
    model: str,
    concurrency: int,
    seed: int,
    result_json: Path,
) -> list[str]:
    """Every request asks for exactly output_len tokens: `ignore_eos` where the server has it,
    llama-cpp-python's `min_tokens` (EOS held back until then) where it has not; its default
    repeat penalty (1.1) off, as the others sample."""
    args = ["--base-url", base_url, "--model", model, "--tokenizer", str(w.tokenizer)]
    args += ["--dataset", "random", "--num-prompts", str(w.num_prompts)]
    args += ["--input-len", str(w.input_len), "--output-len", str(w.output_len)]
    args += ["--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos"]
    args += ["--label", f"{system} c={concurrency}", "--result-json", str(result_json)]
    args += ["--disable-tqdm"]
    if system == "llamacpp":  # its /v1/completions takes text prompts only
        body = {"min_tokens": w.output_len, "repeat_penalty": 1.0}
        args += ["--prompt-format", "text", "--extra-body", json.dumps(body)]
    return args + list(w.extra)


def run(args: list[str]) -> dict[str, Any]:
    """Runs `deepinfer bench serve ARGS`; the result file's contents."""
    parser = argparse.ArgumentParser(prog="deepinfer bench serve")
    add_serve_arguments(parser)
    ns = parser.parse_args(args)
    if bench_serve(ns) != 0:
        raise WorkloadError(f"`deepinfer bench serve {' '.join(args)}` completed no request")
    return json.loads(Path(ns.result_json).read_text())
