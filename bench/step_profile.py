"""Time by op class of a window of steady engine steps: torch.profiler over each step, every op's
self time put in a class (GEMM, attention, norm, MoE, ...); what the ops leave of the step's
wall time is Python and dispatch."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function

os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # no two lines per profiled step on stderr

STEP = "deepinfer::step"
SCOPE = "deepinfer::scope::"  # + a class: the ops of a module of that kind, or of sampling
PYTHON = "python/dispatch"
CLASSES = (
    "gemm",
    "attention",
    "norm",
    "moe",
    "hyper-connections",
    "mlp activation",
    "sampling",
    "fused layers",
    "compiled code",
    "other ops",
    PYTHON,
)

# ops that are (or wrap) a matrix product; their children (transposes, reshapes) count with them
GEMM_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::einsum",
    "aten::mv",
    "aten::addmv",
    "aten::_grouped_mm",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm",
    "mkldnn::_linear_pointwise",
    "deepinfer::packed_linear",  # its own share: the lookup of the packed weight, the reshapes
}
# module class name (a substring of it) -> class of the non-GEMM ops run inside it
MODULE_CLASSES = (
    ("Norm", "norm"),
    ("MoE", "moe"),
    ("Hyper", "hyper-connections"),
    ("Attention", "attention"),
    ("Indexer", "attention"),
    ("Compressor", "attention"),
    ("MLP", "mlp activation"),
    ("SharedExpert", "mlp activation"),
)


# ops that run whole layers in C++ (their GEMMs, attention and norms not told apart): the
# fused dense decode step, whose GEMMs of more than 2 rows still show as children
FUSED_OPS = {"deepinfer::dense_decode_layers"}


def op_class(name: str) -> str | None:
    """The class an op's own name gives it, if any."""
    if name in GEMM_OPS:
        return "gemm"
    if name in FUSED_OPS:
        return "fused layers"
    low = name.lower()
    if low.startswith(("torch-compiled region", "torchdynamo", "cpp_fused")) or "compiledfx" in low:
        return "compiled code"  # guards, wrappers, generated kernels (not their extern GEMMs)
    if "attention" in low or "paged" in low:
        return "attention"
    if "norm" in low:
        return "norm"
    return None


def module_class(module: torch.nn.Module) -> str | None:
    kind = type(module).__name__
    return next((c for part, c in MODULE_CLASSES if part in kind), None)


def classify(event: Any) -> str:
    """An op inside a MoE block is MoE; otherwise the nearest of itself and its ancestors
    that names a class (a GEMM, an attention or norm op, a module scope) decides."""
    chain = []
    e = event
    while e is not None and e.name != STEP:
        chain.append(e.name)
        e = e.cpu_parent
    if SCOPE + "moe" in chain:
        return "moe"
    for name in chain:
        if name.startswith(SCOPE):
            return name[len(SCOPE) :]
        if (c := op_class(name)) is not None:
            return c
    return "other ops"


def decode_at(batch: int = 0) -> Callable[[Any], bool]:
    """Picks the decode-only prepared steps of `batch` sequences (0: of any batch)."""

    def want(step: Any) -> bool:
        n = step.logits_rows.numel()
        return step.input_ids.numel() == n and (batch == 0 or n == batch)

    return want


def descendants(event: Any) -> Iterator[Any]:
    for child in event.cpu_children:
        yield child
        yield from descendants(child)


@dataclass
class StepBreakdown:
    wall_us: float
    classes_us: Counter
    ops: Counter  # op name -> self time (us)
    count: int  # ops called from Python (not from inside another op)
    events: int  # every op, those inside others too


def breakdown(events: Any) -> list[StepBreakdown]:
    """Per step marker in a profile's events: its wall time, the ops' self time by class, the
    rest (the wall time minus every op's self time) as Python/dispatch."""
    steps = []
    for step in events:
        if step.name != STEP:
            continue
        classes: Counter = Counter()
        ops: Counter = Counter()
        count = events = 0
        for e in descendants(step):
            if e.name.startswith(SCOPE):
                continue  # a marker: its self time is Python between the ops inside it
            classes[classify(e)] += e.self_cpu_time_total
            ops[e.name] += e.self_cpu_time_total
            events += 1
            parent = e.cpu_parent.name
            count += parent == STEP or parent.startswith(SCOPE)
        wall = step.time_range.end - step.time_range.start
        classes[PYTHON] = max(wall - sum(classes.values()), 0.0)
        steps.append(StepBreakdown(wall, classes, ops, count, events))
    return steps


@dataclass
class StepOpProfile:
    """Wraps `engine.runner.execute`: of the steps `want(prepared_step)` picks, skips `skip`,
    profiles the next `steps` (torch.profiler, module scopes via forward hooks) and times the
    rest without the profiler."""

    engine: Any
    want: Callable[[Any], bool]
    steps: int = 10
    skip: int = 3
    results: list[StepBreakdown] = field(default_factory=list)
    unprofiled_ms: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    _seen: int = 0
    _execute: Any = None

    def __enter__(self) -> StepOpProfile:
        self._execute = self.engine.runner.execute
        # kineto registers with the thread that first profiles: this one, not the device's
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            pass

        def execute(step: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.want(step):
                return self._execute(step, *args, **kwargs)
            self._seen += 1
            if self._seen <= self.skip or len(self.results) >= self.steps:
                t0 = time.perf_counter()
                result = self._execute(step, *args, **kwargs)
                self.unprofiled_ms.append(1e3 * (time.perf_counter() - t0))
                return result
            self.batches.append(step.logits_rows.numel())
            return self._profiled(step, *args, **kwargs)

        self.engine.runner.execute = execute
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.runner.execute = self._execute

    def _profiled(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        model = self.engine.runner.model
        handles, sampling = _scope_hooks(model), []
        compute_logits = model.compute_logits

        def scoped_logits(hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
            rf = record_function(SCOPE + "sampling")  # until the step ends: logits and sampling
            rf.__enter__()
            sampling.append(rf)
            return compute_logits(hidden, upcast)

        model.compute_logits = scoped_logits
        try:
            cpu = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=cpu) as prof, record_function(STEP):
                result = self._execute(step, *args, **kwargs)
                for rf in sampling:
                    rf.__exit__(None, None, None)
        finally:
            del model.compute_logits
            for h in handles:
                h.remove()
        self.results.extend(breakdown(prof.events()))
        return result

    def summary(self) -> dict[str, Any]:
        n = len(self.results)
        if n == 0:
            return {"steps": 0}
        classes = {c: sum(r.classes_us[c] for r in self.results) / n / 1e3 for c in CLASSES}
        ops: Counter = Counter()
        for r in self.results:
            ops.update(r.ops)
        wall = statistics.mean(r.wall_us for r in self.results) / 1e3
        return {
            "steps": n,
            "batch": statistics.median(self.batches),
            "step_ms_profiled": wall,
            "step_ms_unprofiled": statistics.median(self.unprofiled_ms)
            if self.unprofiled_ms
            else None,
            "ops_per_step": statistics.mean(r.count for r in self.results),
            "op_events_per_step": statistics.mean(r.events for r in self.results),
            "classes_ms": classes,
            "top_ops_ms": {k: v / n / 1e3 for k, v in ops.most_common(15)},
        }


def _scope_hooks(model: torch.nn.Module) -> list[Any]:
    """Forward pre/post hooks that open and close a scope marker around each module of a
    known kind (hooks are not traced into a compiled region; its ops go by their names)."""
    handles = []
    for module in model.modules():
        cls = module_class(module)
        if cls is None:
            continue
        stack: list[Any] = []

        def enter(_m: Any, _args: Any, stack: list[Any] = stack, cls: str = cls) -> None:
            rf = record_function(SCOPE + cls)
            rf.__enter__()
            stack.append(rf)

        def leave(_m: Any, _args: Any, _out: Any, stack: list[Any] = stack) -> None:
            stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    return handles


def report(title: str, summary: dict[str, Any]) -> str:
    """The summary as a table: ms per step and share of the profiled step, by class."""
    if not summary.get("steps"):
        return f"{title}: no steps profiled"
    wall = summary["step_ms_profiled"]
    unprofiled = summary["step_ms_unprofiled"]
    lines = [
        f"{title}: {summary['steps']} steps at batch {summary['batch']:g}, "
        f"{summary['ops_per_step']:.0f} torch ops per step from Python "
        f"({summary['op_events_per_step']:.0f} with those they call); "
        f"step {wall:.1f} ms under the profiler"
        + (f", {unprofiled:.1f} ms without" if unprofiled is not None else ""),
        f"  {'op class':<20} {'ms/step':>8} {'share':>6}",
    ]
    for c, ms in summary["classes_ms"].items():
        lines.append(f"  {c:<20} {ms:>8.2f} {ms / wall:>6.1%}")
    lines.append(
        "  top ops by self time (ms/step): "
        + ", ".join(f"{k} {v:.2f}" for k, v in list(summary["top_ops_ms"].items())[:6])
    )
    return "\n".join(lines)


def write_json(path: Path, title: str, summary: dict[str, Any], **context: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"title": title, **context, **summary}, indent=2) + "\n")
    print(f"step profile: {path}")
