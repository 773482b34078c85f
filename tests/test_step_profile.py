"""bench/step_profile.py: a step's ops put in their classes (by name, by module scope, MoE
above all), the rest of its wall time as Python/dispatch; on a real engine's decode steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.autograd.profiler import record_function

from bench.common import profile_steps
from bench.step_profile import (
    CLASSES,
    PYTHON,
    STEP,
    StepOpProfile,
    _scope_hooks,
    breakdown,
    decode_at,
    report,
    write_json,
)
from daemon.models.layers import RMSNorm


class MoE(nn.Module):  # a module of the MoE kind, by its class name
    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.expert(x), dim=-1) * x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj, self.moe = RMSNorm(16, 1e-6), nn.Linear(16, 16), MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.proj(self.norm(x))) + x.exp()


def test_ops_go_to_their_classes() -> None:
    block = Block()
    handles = _scope_hooks(block)
    with torch.no_grad(), torch.profiler.profile() as prof, record_function(STEP):
        block(torch.randn(4, 16))
    for h in handles:
        h.remove()
    (step,) = breakdown(prof.events())
    cls = step.classes_us
    assert cls["gemm"] > 0  # proj (nn.Linear outside the MoE)
    assert cls["norm"] > 0  # RMSNorm's pow / mean / rsqrt / mul, by its module
    assert cls["moe"] > 0  # the expert's GEMM and the softmax, inside the MoE module
    assert cls["other ops"] > 0  # the exp and the residual add
    assert cls["attention"] == cls["sampling"] == 0
    assert set(cls) <= set(CLASSES)
    # every op's self time plus the rest (Python) is the step's wall time
    assert sum(cls.values()) == pytest.approx(step.wall_us) and cls[PYTHON] >= 0
    assert "aten::addmm" in step.ops and step.events >= step.count >= 8


def test_a_real_engine_profiles_its_decode_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    import asyncio

    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine
    from daemon.loop.request import SamplingParams

    engine, _ = build_engine(
        EngineConfig(model=str(tiny_model_dir), kv_cache_memory_gb=0.02, max_num_seqs=4)
    )
    timers = profile_steps(engine)  # the benchmarks' step timers, wrapped around the engine
    ops = StepOpProfile(engine, decode_at(3), steps=4, skip=2)

    async def run() -> None:
        await engine.start()
        try:
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            with ops:
                await asyncio.gather(
                    *(_drain(engine.generate([5 + i, 6, 7, 8], params)) for i in range(3))
                )
        finally:
            await engine.stop()

    asyncio.run(run())
    summary = ops.summary()
    assert summary["steps"] == 4 and summary["batch"] == 3
    assert len(timers.schedule) == len(timers.prepare) == len(timers.execute) >= 12
    assert 3 in timers.decode_steps and len(timers.process) == len(timers.execute)
    assert engine.runner.execute == ops._execute  # unwrapped again
    classes = summary["classes_ms"]
    for c in ("gemm", "attention", "norm", "sampling"):
        assert classes[c] > 0, c
    assert summary["ops_per_step"] > 10 and len(ops.unprofiled_ms) >= 2
    text = report("tiny decode", summary)
    assert "tiny decode: 4 steps at batch 3" in text and "python/dispatch" in text
    write_json(tmp_path / "p.json", "tiny decode", summary, bench="test")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["bench"] == "test" and data["classes_ms"]["gemm"] == classes["gemm"]


async def _drain(outputs) -> None:
    async for _ in outputs:
        pass
