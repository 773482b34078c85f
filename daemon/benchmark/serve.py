"""`deepinfer bench serve`: drive an OpenAI-compatible /v1/completions endpoint with a seeded
workload, streamed, and report throughput, latency percentiles and goodput, as `vllm bench serve`.

Prompts are token ids by default (`--prompt-format ids`). Multi-turn traces (chat, agent) grow
each session's prompt by the answer's own token ids, which the request asks for with
`return_token_ids: true` (deepinfer and vLLM return them in each streamed chunk). Servers that
take only text prompts and return only text (`transformers serve`) need `--prompt-format text
--tokenizer DIR`: the workload's ids are decoded to text and a session's next prompt is the
previous prompt's text + the answer's text + the next message's text, counted by the server's
usage (else by the local tokenizer). No answer is ever made up: a turn whose answer ids are
missing in ids mode fails the session with that message. `--dataset jsonl` sends the requests of
a file, each once: prompts, or chat messages to a chat endpoint (`--endpoint /v1/chat/completions`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from daemon.benchmark.client import Payload, RequestRecord, Target, stream_request
from daemon.benchmark.datasets import (
    Codec,
    DatasetError,
    Prompt,
    TokenSource,
    jsonl_prompts,
    prefix_sharing_prompts,
    random_prompts,
    scaled_params,
    trace_sessions,
)
from daemon.benchmark.metrics import Summary, report, summarize
from daemon.benchmark.options import DEFAULT_NUM_PROMPTS
from daemon.benchmark.traces import DEFAULTS, Session

TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600, sock_connect=10)
TRACE_DATASETS = ("chat", "agent")


class BenchError(Exception):
    """A problem to report in one line, without a traceback."""


@dataclass
class Run:
    """What every request of the run shares."""

    http: aiohttp.ClientSession
    target: Target
    codec: Codec | None
    sem: asyncio.Semaphore | None
    bar: tqdm
    t0: float
    records: list[RequestRecord]

    async def send(
        self,
        prompt: Payload,
        rec: RequestRecord,
        headers: dict[str, str] | None = None,
        gate: bool = True,
    ) -> RequestRecord:
        """One request; `gate`: wait for a --max-concurrency slot (False: the caller holds
        one, released here)."""
        self.records.append(rec)
        if isinstance(prompt, list):
            rec.prompt_tokens = len(prompt) if prompt and isinstance(prompt[0], int) else 0
        elif self.codec is not None:
            rec.prompt_tokens = self.codec.count(prompt)
        count = self.codec.count if self.codec is not None else None
        try:
            async with self.sem if gate and self.sem else contextlib.nullcontext():
                await stream_request(self.http, self.target, prompt, rec, self.t0, headers, count)
        finally:
            if not gate and self.sem is not None:
                self.sem.release()
        self.bar.update()
        return rec


def main(args: argparse.Namespace) -> int:
    try:
        _check(args)
        return asyncio.run(_main(args))
    except BenchError as e:
        print(f"deepinfer bench serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _check(a: argparse.Namespace) -> None:
    trace = a.dataset in TRACE_DATASETS
    if (a.dataset == "jsonl") != (a.dataset_path is not None):
        raise BenchError("--dataset jsonl and --dataset-path FILE go together")
    if a.dataset == "jsonl":
        try:
            a.jsonl = jsonl_prompts(a.dataset_path, a.output_len)
        except (OSError, DatasetError) as e:
            raise BenchError(f"--dataset-path: {e}") from None
        if a.num_prompts is not None and a.num_prompts > len(a.jsonl):
            raise BenchError(
                f"--num-prompts {a.num_prompts}: {a.dataset_path} holds {len(a.jsonl)}"
            )
        if a.duration is not None:
            raise BenchError(
                "--duration does not apply to --dataset jsonl (each line is sent once)"
            )
    if a.num_prompts is not None and a.num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise BenchError("--max-concurrency must be at least 1")
    if a.request_rate is not None and a.request_rate <= 0:
        raise BenchError("--request-rate must be positive (inf: all at once)")
    if trace and a.request_rate is not None:
        raise BenchError(
            f"--request-rate does not apply to --dataset {a.dataset}: arrivals come from the "
            "trace (scale them with --time-scale)"
        )
    if trace and a.duration is not None:
        raise BenchError(f"--duration does not apply to --dataset {a.dataset}")
    if a.duration is not None:
        if a.duration <= 0:
            raise BenchError("--duration must be positive")
        if a.max_concurrency is None and not math.isfinite(a.request_rate or math.inf):
            raise BenchError("--duration needs --max-concurrency or a finite --request-rate")
    if min(a.input_len, a.output_len) < 1 or not 0 <= a.range_ratio < 1:
        raise BenchError("--input-len and --output-len must be >= 1, --range-ratio in [0, 1)")
    if a.extra_body is not None:
        try:
            extra = json.loads(a.extra_body)
        except json.JSONDecodeError as e:
            raise BenchError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise BenchError("--extra-body must be a JSON object")


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def _main(a: argparse.Namespace) -> int:
    base = _base_url(a.base_url)
    key = a.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    codec = _codec(a)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as http:
        model = a.model or await _first_model(http, base, headers)
        target = Target(
            url=base + "/" + a.endpoint.lstrip("/"),
            model=model,
            headers=headers,
            prompt_format=a.prompt_format,
            temperature=a.temperature,
            ignore_eos=a.ignore_eos,
            extra_body=json.loads(a.extra_body) if a.extra_body else {},
        )
        await _preflight(http, target, codec, a)
        label = a.label or model
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        print(_describe(a, target, label), flush=True)
        records: list[RequestRecord] = []
        total = None if a.duration is not None else _planned(a)
        bar = tqdm(total=total, unit="req", disable=a.disable_tqdm, dynamic_ncols=True)
        run = Run(http, target, codec, sem, bar, time.perf_counter(), records)
        try:
            if a.dataset in TRACE_DATASETS:
                await _run_sessions(run, _sessions(a, codec), a.time_scale)
            else:
                await _run_flat(run, _prompts(a, codec), a)
        finally:
            bar.close()
        duration = time.perf_counter() - run.t0
    slos = dict(a.goodput) if a.goodput else None
    summary = summarize(records, duration, slos)
    print(report(summary, label))
    if a.result_json:
        _write_json(a, target, label, summary, records)
    if a.plot:
        from daemon.benchmark.plot import from_records, plot

        plot([from_records(label, [r.to_json() for r in records])], a.plot, label)
        print(f"plot: {a.plot}")
    return 0 if summary.completed else 1


def _codec(a: argparse.Namespace) -> Codec | None:
    path = a.tokenizer
    if path is None and a.model and Path(a.model).is_dir():
        path = a.model
    try:
        codec = Codec(path) if a.tokenizer else Codec.find(path)
    except Exception as e:  # tokenizers raises plain Exceptions
        raise BenchError(f"cannot load the tokenizer {path}: {e}") from None
    if a.prompt_format == "text" and codec is None:
        raise BenchError("--prompt-format text needs --tokenizer (tokenizer.json or its directory)")
    return codec


async def _first_model(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> str:
    url = base + "/v1/models"
    try:
        async with http.get(url, headers=headers) as resp:
            if resp.status != 200:
                raise BenchError(
                    f"GET {url} answered {resp.status}: {(await resp.text())[:200]}; "
                    "name the model with --model"
                )
            data = await resp.json()
    except (aiohttp.ClientError, OSError) as e:
        raise BenchError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models:
        raise BenchError(f"GET {url} lists no model; name one with --model")
    return str(models[0]["id"])


async def _preflight(
    http: aiohttp.ClientSession, target: Target, codec: Codec | None, a: argparse.Namespace
) -> None:
    """One short request before the run (not counted): wrong URL, model, key or a field the
    server rejects fail here, with the server's message."""
    src = TokenSource(a.seed + 7919, a.vocab_size, codec)
    ids = src.ids(8)
    prompt: Payload = codec.text_of(ids) if a.prompt_format == "text" and codec else ids
    if a.dataset == "jsonl" and a.jsonl[0].messages is not None:
        prompt = [{"role": "user", "content": "Hello"}]  # not the file's: no cache hit made
    rec = await stream_request(http, target, prompt, RequestRecord(-1, 2), time.perf_counter())
    if not rec.ok:
        msg = rec.error or "no answer"
        if msg.startswith(("ClientConnector", "ClientOSError", "ServerDisconnected")):
            raise BenchError(f"cannot reach {target.url}: {msg}")
        raise BenchError(f"the test request to {target.url} failed: {msg}")


def _planned(a: argparse.Namespace) -> int | None:
    if a.dataset in TRACE_DATASETS:
        return None  # set once the trace is built
    if a.dataset == "jsonl":
        return a.num_prompts or len(a.jsonl)
    return a.num_prompts or DEFAULT_NUM_PROMPTS


def _prompts(a: argparse.Namespace, codec: Codec | None) -> Iterator[Prompt]:
    if a.dataset == "jsonl":
        return iter(a.jsonl)
    src = TokenSource(a.seed, a.vocab_size, codec)
    text = codec if a.prompt_format == "text" else None
    if a.dataset == "random":
        return random_prompts(src, a.input_len, a.output_len, a.range_ratio, text)
    return prefix_sharing_prompts(
        src, a.prefix_len, a.num_prefixes, a.input_len, a.output_len, a.range_ratio, text
    )


def _sessions(a: argparse.Namespace, codec: Codec | None) -> list[Session]:
    vocab = TokenSource(a.seed, a.vocab_size, codec).vocab_size
    params = scaled_params(DEFAULTS[a.dataset], a.length_scale, a.turns, a.max_context)
    return trace_sessions(a.dataset, a.num_sessions, a.seed, vocab, params, a.num_prompts)


async def _run_flat(run: Run, prompts: Iterator[Prompt], a: argparse.Namespace) -> None:
    """Poisson arrivals at --request-rate (inf: at once), at most --max-concurrency in flight,
    --num-prompts requests or fresh ones until --duration has passed."""
    rate = a.request_rate or math.inf
    arrivals = random.Random(f"arrivals-{a.seed}")
    count = _planned(a) if a.duration is None else a.num_prompts
    tasks: list[asyncio.Task] = []
    next_s = 0.0
    for i in itertools.count():
        if count is not None and i >= count:
            break
        if math.isfinite(rate):
            next_s += arrivals.expovariate(rate)
            await asyncio.sleep(max(0.0, run.t0 + next_s - time.perf_counter()))
        if run.sem is not None:
            await run.sem.acquire()  # a request starts when a slot frees, as in vLLM
        if a.duration is not None and time.perf_counter() - run.t0 >= a.duration:
            if run.sem is not None:
                run.sem.release()
            break
        p = next(prompts)
        rec = RequestRecord(i, p.max_tokens)
        tasks.append(asyncio.create_task(run.send(p.payload, rec, gate=False)))
        if len(tasks) >= 4096:  # long --duration runs: keep only pending tasks
            await asyncio.gather(*(t for t in tasks if t.done()))
            tasks = [t for t in tasks if not t.done()]
    await asyncio.gather(*tasks)


async def _run_sessions(run: Run, groups: list[Session], scale: float) -> None:
    """Each session a task: turn 0 at its arrival, turn k after turn k-1's answer plus its
    think time, all times * scale."""
    run.bar.reset(total=sum(len(s.turns) for s in groups))
    counter = itertools.count()

    async def session(s: Session) -> None:
        await asyncio.sleep(s.turns[0].arrival_s * scale)
        text = ""
        while not s.done:
            if s.next_turn:
                await asyncio.sleep(s.turns[s.next_turn].think_time_s * scale)
            turn, ids = s.prompt()
            rec = RequestRecord(next(counter), turn.max_tokens, turn.session, turn.index)
            if run.target.prompt_format == "text":
                assert run.codec is not None
                text += run.codec.decode(turn.new_tokens)
                prompt: list[int] | str = text
            else:
                prompt = ids
            await run.send(prompt, rec, {"X-Traffic-Class": turn.traffic_class})
            if rec.ok and run.target.prompt_format == "ids" and rec.answer_ids is None:
                rec.ok = False
                rec.error = (
                    "the server returned no token ids (return_token_ids); use "
                    "--prompt-format text --tokenizer DIR for multi-turn traces"
                )
            if not rec.ok:
                run.bar.update(len(s.turns) - s.next_turn)  # the rest of the session is dropped
                return
            s.answered(rec.answer_ids or [])
            text += rec.answer_text

    await asyncio.gather(*(session(s) for s in groups))


def _describe(a: argparse.Namespace, target: Target, label: str) -> str:
    load = (
        f"max concurrency {a.max_concurrency or 'unlimited'}, "
        + (
            f"time scale {a.time_scale:g}"
            if a.dataset in TRACE_DATASETS
            else f"request rate {a.request_rate or math.inf:g}/s"
        )
        + (f", duration {a.duration:g} s" if a.duration else "")
    )
    return (
        f"bench serve [{label}]: {target.url}, model {target.model}, dataset {a.dataset}, "
        f"prompts as {a.prompt_format}, {load}"
    )


def _write_json(
    a: argparse.Namespace,
    target: Target,
    label: str,
    summary: Summary,
    records: list[RequestRecord],
) -> None:
    skip = ("api_key", "command", "bench_command", "jsonl")
    config: dict[str, Any] = {k: v for k, v in vars(a).items() if k not in skip}
    config |= {
        "label": label,
        "model": target.model,
        "url": target.url,
        "goodput": dict(a.goodput) if a.goodput else None,
    }
    out = {
        "config": config,
        "summary": asdict(summary),
        "requests": [r.to_json() for r in records],
    }
    path = Path(a.result_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(out), indent=1, default=str, allow_nan=False) + "\n")
    print(f"results: {path}")


def _finite(x: Any) -> Any:
    """NaN (an empty percentile) -> null, so the file is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
