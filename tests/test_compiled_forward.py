"""The compiled CPU forward (daemon/models/compiled.py): greedy outputs equal the eager
engine's, alone and batched, across batch sizes and KV widths, with mixed steps (compiled
halves around the eager attention) between them and prefix-cache hits; the graphs compiled at
start and none after; inductor's code kept under deepinfer's cache directory."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.request import SamplingParams
from daemon.models.compiled import CompiledDecode
from tests.checkpoints import make_dense_checkpoint

PROMPT_LENGTHS = [3, 17, 40, 64, 90, 5, 33, 120, 7]  # KV widths of 1 to 9 blocks
MAX_NUM_SEQS = 8  # below the prompts: the batch shrinks and grows as requests come and go


@dataclass
class Run:
    batched: list[list[int]]
    alone: list[list[int]]  # each prompt again: prefix-cache hits on the blocks written before
    graphs: type | None = None
    # (decodes, KV blocks, prefill chunks) of each step the compiled forward ran
    compiled_steps: list[tuple[int, int, int]] = field(default_factory=list)
    graphs_at_start: int = 0  # graphs dynamo made while the engine was built
    graphs_serving: int = 0  # ... and while it served


def _serve(checkpoint: Path, prompts: list[list[int]], eager: bool) -> Run:
    before = counters["stats"]["unique_graphs"]
    engine, _ = build_engine(
        EngineConfig(
            model=str(checkpoint),
            device="cpu",
            kv_cache_memory_gb=0.05,
            max_num_seqs=MAX_NUM_SEQS,
            enforce_eager=eager,
        )
    )
    built = counters["stats"]["unique_graphs"]
    graphs = engine.runner.graphs
    steps: list[tuple[int, int, int]] = []
    if graphs is not None:
        run = graphs.run

        def spy(input_ids, positions, batch):
            hidden = run(input_ids, positions, batch)
            if hidden is not None:
                steps.append((batch.num_decodes, batch.decode_tables.shape[1], len(batch.prefills)))
            return hidden

        graphs.run = spy

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        await engine.start()

        async def one(i: int) -> list[int]:
            # lengths that differ: the batch shrinks one request at a time
            greedy = SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)
            outs = engine.generate(prompts[i], greedy)
            return [t async for out in outs for t in out.new_token_ids]

        try:
            batched = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            alone = [await one(i) for i in range(len(prompts))]
        finally:
            await engine.stop()
        return batched, alone

    batched, alone = asyncio.run(main())
    served = counters["stats"]["unique_graphs"]
    return Run(
        batched, alone, type(graphs) if graphs else None, steps, built - before, served - built
    )


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """deepinfer's cache directory for this module, inductor's not set: the engine puts it there."""
    root = tmp_path_factory.mktemp("deepinfer-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(root))
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded, so that leaving restores it
        mp.delenv("TORCHINDUCTOR_CACHE_DIR")
        yield root


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def runs(request: pytest.FixtureRequest, cache_root: Path, tmp_path_factory) -> tuple[Run, Run]:
    """(eager, compiled) on one tiny checkpoint; Qwen3 adds the per-head q/k norms."""
    checkpoint = make_dense_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return _serve(checkpoint, prompts, eager=True), _serve(checkpoint, prompts, eager=False)


def test_compiled_tokens_equal_eager(runs: tuple[Run, Run]) -> None:
    eager, compiled = runs
    assert eager.graphs is None and compiled.graphs is CompiledDecode
    assert compiled.batched == eager.batched
    assert compiled.alone == eager.alone
    assert eager.batched == eager.alone


def test_compiled_steps_span_batches_and_widths(runs: tuple[Run, Run]) -> None:
    """Batch 1 and larger batches, narrow and wide KV, all through the compiled forward."""
    steps = [(b, w) for b, w, chunks in runs[1].compiled_steps if not chunks]
    assert {b for b, _ in steps} >= {1, MAX_NUM_SEQS} and len({b for b, _ in steps}) > 2
    assert min(w for _, w in steps) == 1 and max(w for _, w in steps) >= 8


def test_steps_with_prefill_chunks_run_compiled(runs: tuple[Run, Run]) -> None:
    """Prefill-only steps and prefill chunks beside decodes, through the compiled halves."""
    mixed = [(b, chunks) for b, _, chunks in runs[1].compiled_steps if chunks]
    assert any(b == 0 for b, _ in mixed) and any(b > 0 for b, _ in mixed)
    assert max(chunks for _, chunks in mixed) > 1


def test_graphs_are_made_at_start_only(runs: tuple[Run, Run]) -> None:
    """The warm-up makes the decode graph and the two halves'; serving makes none."""
    compiled = runs[1]
    assert compiled.graphs_at_start == 3
    assert compiled.graphs_serving == 0


def test_inductor_code_lies_in_the_cache_directory(runs: tuple[Run, Run], cache_root: Path) -> None:
    assert any((cache_root / "inductor").rglob("*.py"))


_WITHOUT_COMPILER = """
import asyncio, sys
from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.request import SamplingParams
engine, _ = build_engine(EngineConfig(model=sys.argv[1], kv_cache_memory_gb=0.05, max_num_seqs=2))
assert engine.runner.graphs.failed

async def main():
    await engine.start()
    try:
        p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return [t async for o in engine.generate([5, 6, 7], p) for t in o.new_token_ids]
    finally:
        await engine.stop()

print("tokens", len(asyncio.run(main())))
"""


def test_without_a_cxx_compiler_the_engine_serves_on_the_torch_paths(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.daemons import ROOT, checkout_env

    checkpoint = make_dense_checkpoint(tmp_path / "m", "llama")
    env = checkout_env() | {
        "DEEPINFER_ENGINE_ENFORCE_EAGER": "0",
        "CXX": str(tmp_path / "no-such-compiler"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),  # the C++ kernels unbuilt too
    }
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_COMPILER, str(checkpoint)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens 4" in done.stdout
    assert "decode_forward_not_compiled" in done.stdout + done.stderr
    assert "cpu_kernels_unavailable" in done.stdout + done.stderr  # the torch paths serve
