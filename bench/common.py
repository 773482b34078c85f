"""Shared benchmark helpers: the dense model spec (checkpoints from daemon.models.checkpoints),
seeded workloads, engine runs, stats."""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from tqdm import tqdm

from daemon.models.checkpoints import make_dense_checkpoint


def quiet_logs() -> None:
    """Engine and transformers chatter off; benchmark results are printed."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


# ---- model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style dense model; random weights, no tokenizer."""

    num_layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1536
    vocab: int = 32000
    max_positions: int = 2048
    explicit_head_dim: int = 0  # a config's head_dim where it is not hidden / heads

    @classmethod
    def from_config(cls, path: Path) -> ModelSpec:
        """The spec of a saved Llama-style checkpoint (its config.json), for FLOP counts."""
        c = json.loads((Path(path) / "config.json").read_text())
        heads = c["num_attention_heads"]
        return cls(
            c["num_hidden_layers"],
            c["hidden_size"],
            heads,
            c.get("num_key_value_heads", heads),
            c["intermediate_size"],
            c["vocab_size"],
            c.get("max_position_embeddings", 2048),
            c.get("head_dim") or 0,
        )

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    def matmul_params(self) -> int:
        """Weights one token multiplies by: qkv, o, gate/up/down per layer, plus lm_head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = (
            self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        )
        return self.num_layers * per_layer + self.hidden * self.vocab

    def token_flops(self, ctx: int) -> float:
        """FLOPs to produce one token at context length `ctx` (matmuls + QK^T and PV)."""
        attention = 4 * ctx * self.heads * self.head_dim * self.num_layers
        return 2 * self.matmul_params() + attention

    def describe(self, dtype: str = "fp32") -> str:
        return (
            f"llama {self.num_layers}L hidden {self.hidden} heads {self.heads}/{self.kv_heads} "
            f"ffn {self.intermediate} vocab {self.vocab} {dtype} "
            f"({self.matmul_params() / 1e6:.1f}M matmul params)"
        )


def make_checkpoint(spec: ModelSpec, root: Path | None = None, seed: int = 0) -> Path:
    """Save a random-weight LlamaForCausalLM (config.json + model.safetensors) and return its dir
    (a temp dir, removed at exit, unless `root` is given).

    No eos token: nothing can stop a generation before its length limit.
    """
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="deepinfer-bench-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    return make_dense_checkpoint(
        Path(root),
        "llama",
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        layers=spec.num_layers,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        seed=seed,
        intermediate_size=spec.intermediate,
        max_position_embeddings=spec.max_positions,
        initializer_range=0.02,  # transformers' default, not the tests' peaked 0.2
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
        dtype="float32",
    )


# ---- workload -------------------------------------------------------------------------------


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def make_workload(
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab: int,
    seed: int = 0,
) -> list[Request]:
    """`n` requests with uniform random prompt and output lengths (inclusive ranges)."""
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*output_range),
        )
        for _ in range(n)
    ]


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


# ---- our engine -----------------------------------------------------------------------------


def build_ours(
    path: Path,
    overlap: bool = True,
    kv_cache_memory_gb: float = 1.0,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    cpu_threads: int = 0,
    device: str = "cpu",
    dtype: str = "auto",
) -> Any:
    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    cfg = EngineConfig(
        model=str(path),
        device=device,
        kv_cache_memory_gb=kv_cache_memory_gb,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        overlap=overlap,
        cpu_threads=cpu_threads,
        dtype=dtype,
    )
    engine, _ = build_engine(cfg)
    return engine


@dataclass
class RequestTiming:
    submitted: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


@dataclass
class EngineRun:
    elapsed: float
    output_tokens: int
    timings: list[RequestTiming]
    loop_cpu: float = 0.0  # CPU seconds the event-loop thread used (scheduling, outputs, clients)
    steps: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.elapsed


async def run_ours(engine: Any, workload: list[Request], desc: str | None = None) -> EngineRun:
    """Submit every request at t=0 (greedy, ignore_eos) and wait for all; checks output lengths."""
    from daemon.loop.request import SamplingParams

    bar = tqdm(
        total=sum(r.max_tokens for r in workload),
        desc=desc,
        unit="tok",
        leave=False,
        disable=desc is None,
    )

    async def one(req: Request, timing: RequestTiming) -> int:
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        count = 0
        async for out in engine.generate(req.prompt, params):
            if out.new_token_ids:
                now = time.perf_counter()
                timing.token_times.extend([now] * len(out.new_token_ids))
                count += len(out.new_token_ids)
                bar.update(len(out.new_token_ids))
        if count != req.max_tokens:
            raise RuntimeError(f"asked for {req.max_tokens} tokens, got {count}")
        return count

    steps0, cpu0 = engine.steps, time.thread_time()
    t0 = time.perf_counter()
    timings = [RequestTiming(t0) for _ in workload]
    counts = await asyncio.gather(*(one(r, t) for r, t in zip(workload, timings)))
    elapsed = time.perf_counter() - t0
    cpu = time.thread_time() - cpu0
    bar.close()
    return EngineRun(elapsed, sum(counts), timings, cpu, engine.steps - steps0)


# ---- engine step profiling -------------------------------------------------------------------


@dataclass
class StepProfile:
    """Wall time of the engine's three per-step calls, gathered by wrapping them."""

    schedule: list[float] = field(default_factory=list)
    prepare: list[float] = field(default_factory=list)
    execute: list[float] = field(default_factory=list)
    process: list[float] = field(default_factory=list)  # outputs of a step -> request streams
    batch: list[int] = field(default_factory=list)  # sequences per executed step
    decode_only: list[bool] = field(default_factory=list)
    # the latest decode-only prepared step per batch size, to replay the forward alone
    decode_steps: dict[int, Any] = field(default_factory=dict)

    def summary(self, decode_only: bool | None = None) -> dict[str, float]:
        keep = [
            i for i, d in enumerate(self.decode_only) if decode_only is None or d == decode_only
        ]

        def ms(xs: list[float]) -> float:
            return 1e3 * statistics.median([xs[i] for i in keep]) if keep else float("nan")

        return {
            "steps": len(keep),
            "schedule_ms": ms(self.schedule),
            "prepare_ms": ms(self.prepare),
            "execute_ms": ms(self.execute),
            "process_ms": ms(self.process),
            "batch": statistics.median([self.batch[i] for i in keep]) if keep else 0,
        }


def describe_steps(summary: dict[str, float]) -> str:
    s = summary
    return (
        f"{s['steps']} steps, median batch {s['batch']}, schedule {s['schedule_ms']:.2f} ms, "
        f"prepare {s['prepare_ms']:.2f} ms, execute {s['execute_ms']:.1f} ms, "
        f"process {s['process_ms']:.2f} ms"
    )


def profile_steps(engine: Any) -> StepProfile:
    """Wrap scheduler.schedule, runner.prepare, runner.execute and the engine's output step
    (`_process`) with timers."""
    prof = StepProfile()
    schedule, prepare = engine.scheduler.schedule, engine.runner.prepare
    execute, process = engine.runner.execute, engine._process
    last_schedule = [0.0]

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        step = schedule(*args, **kwargs)
        last_schedule[0] = time.perf_counter() - t
        return step

    def timed_prepare(step: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        prepared = prepare(step, *args, **kwargs)
        prof.prepare.append(time.perf_counter() - t)
        prof.schedule.append(last_schedule[0])
        prof.batch.append(len(step.seqs))
        decode_only = all(s.is_decode for s in step.seqs)
        prof.decode_only.append(decode_only)
        if decode_only:
            prof.decode_steps[len(step.seqs)] = prepared
        return prepared

    def timed_execute(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        result = execute(*args, **kwargs)
        prof.execute.append(time.perf_counter() - t)
        return result

    def timed_process(*args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        process(*args, **kwargs)
        prof.process.append(time.perf_counter() - t)

    engine.scheduler.schedule = timed_schedule
    engine._process = timed_process
    engine.runner.prepare = timed_prepare
    engine.runner.execute = timed_execute
    return prof


def replay_ms(engine: Any, prepared: Any, reps: int = 7) -> float:
    """Median ms of `runner.execute` on one prepared step, run alone on this thread (no event
    loop work beside it). Call after the engine has stopped."""
    return median_us({"step": lambda: engine.runner.execute(prepared)}, reps)["step"] / 1e3


# ---- stats and timing ------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


STAT = {"median": statistics.median, "min": min}


def median_us(
    fns: dict[str, Callable[[], object]], reps: int, stat: str = "median"
) -> dict[str, float]:
    """Median (or best) wall time of each function, called in turn `reps` times after two
    warm-ups. On a shared machine the best of N shows the kernel's cost without the slices
    the scheduler gave to other processes (a 2-thread op waits for its slower thread)."""
    for f in fns.values():
        f(), f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: 1e6 * STAT[stat](v) for k, v in times.items()}


@contextmanager
def timer() -> Iterator[Callable[[], float]]:
    """`with timer() as elapsed: ...; elapsed()` gives seconds since entry (frozen at exit)."""
    t0 = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - t0
    end.append(time.perf_counter())


def machine() -> str:
    return f"{torch.get_num_threads()} torch threads, torch {torch.__version__}"
