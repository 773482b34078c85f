"""The compiled CPU forward (daemon/models/compiled.py): greedy outputs equal the eager
engine's, alone and batched, across batch sizes and KV widths, with mixed steps (compiled
halves around the eager attention) between them and prefix-cache hits, Llama's decode steps
through the fused op and Qwen3's through the compiled layer; the graphs compiled at start and
none after; inductor's code kept under deepinfer's cache directory; the graphs saved
there loaded by a new process without compiling, with the same logits, and a corrupt or
mismatched saved graph compiled again."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.engine import Engine
from daemon.loop.request import SamplingParams
from daemon.models.attention import AttentionBatch, PrefillChunk
from daemon.models.compiled import CompiledDecode
from daemon.models.compiled_artifacts import ISA_FILE, _probe_again
from tests.checkpoints import make_dense_checkpoint
from tests.daemons import ROOT, checkout_env

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
    checkpoint: Path | None = None
    probe: torch.Tensor | None = None  # probe_logits() after the build (compiled only)
    misses: int = 0  # steps whose inputs the graphs' guards refused (run eagerly)
    artifacts: Path | None = None  # where the compiled forward saved its graphs
    fused: bool = False  # decode steps through the fused op (`FusedDecode`)


def engine_config(checkpoint: Path | str, eager: bool = False) -> EngineConfig:
    return EngineConfig(
        model=str(checkpoint),
        device="cpu",
        kv_cache_memory_gb=0.05,
        max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=eager,
    )


def probe_logits(engine: Engine) -> torch.Tensor:
    """Logits of a 20-token prompt's last token (the compiled halves) and of one decode step
    after it (the decode layer), from the engine's compiled forward before it serves; writes
    KV blocks from 1 on, which serving overwrites before it reads them."""
    runner = engine.runner
    graphs, model, bs = runner.graphs, runner.model, runner.cache.block_size
    n = 20
    blocks = torch.arange(1, 1 + -(-(n + 1) // bs))
    pos = torch.arange(n + 1)
    slots = blocks[pos // bs] * bs + pos % bs
    prompt = torch.arange(3, 3 + n)
    torch.set_num_threads(runner.cpu_threads)  # as the device thread's: the same sums
    with torch.inference_mode():
        no_decodes = torch.zeros(0, 1, dtype=torch.long)
        idle = torch.zeros(0, 1, 1, bs, dtype=torch.bool)
        chunk = PrefillChunk(0, n, None, None)
        prefill = AttentionBatch(slots[:n], 0, no_decodes, idle, [chunk], bs)
        first = graphs.run(prompt, pos[:n], prefill)
        mask = (torch.arange(len(blocks) * bs) <= n).view(1, 1, 1, -1)
        decode = AttentionBatch(slots[n:], 1, blocks[None], mask, [], bs)
        second = graphs.run(torch.tensor([7]), pos[n:], decode)
        assert first is not None and second is not None  # both through the graphs
        return torch.cat([model.compute_logits(first[-1:]), model.compute_logits(second)])


def _serve(checkpoint: Path, prompts: list[list[int]], eager: bool) -> Run:
    before = counters["stats"]["unique_graphs"]
    engine, _ = build_engine(engine_config(checkpoint, eager))
    built = counters["stats"]["unique_graphs"]
    graphs = engine.runner.graphs
    steps: list[tuple[int, int, int]] = []
    probe = None
    if graphs is not None:
        probe = probe_logits(engine)
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
        batched,
        alone,
        type(graphs) if graphs else None,
        steps,
        built - before,
        served - built,
        checkpoint,
        probe,
        graphs.misses if graphs else 0,
        graphs.artifacts if graphs else None,
        graphs is not None and graphs.fused is not None,
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


def test_llama_decodes_fused_and_qwen3_through_the_compiled_layer(
    runs: tuple[Run, Run], request: pytest.FixtureRequest
) -> None:
    """The fused op serves Llama; Qwen3's q/k norms are not in it."""
    assert runs[1].fused == (request.node.callspec.params["runs"] == "llama")


def test_graphs_are_made_at_start_only(runs: tuple[Run, Run]) -> None:
    """The warm-up makes the two halves' graphs and, where no fused op runs decode steps, the
    decode layer's; serving makes none."""
    compiled = runs[1]
    assert compiled.graphs_at_start == (2 if compiled.fused else 3)
    assert compiled.graphs_serving == 0
    assert compiled.misses == 0  # every step's inputs passed the graphs' guards


def test_inductor_code_lies_in_the_cache_directory(runs: tuple[Run, Run], cache_root: Path) -> None:
    assert any((cache_root / "inductor").rglob("*.py"))


_LOAD_AGAIN = """
import json, sys, torch
from torch._dynamo.utils import counters
from daemon.build.engine import build_engine
from torch._inductor.cpu_vec_isa import VecISA
from tests.test_compiled_forward import engine_config, probe_logits
probes = []  # inductor's ISA probes this process runs (a child Python each)
real_probe = VecISA._probe_load
VecISA._probe_load = lambda isa, path: probes.append(str(isa)) or real_probe(isa, path)
engine, _ = build_engine(engine_config(sys.argv[1]))
graphs = engine.runner.graphs
torch.save(probe_logits(engine), sys.argv[2])
print("RESULT", json.dumps({
    "loaded": graphs.loaded,
    "failed": graphs.failed,
    "artifacts": str(graphs.artifacts),
    "isa_probes": probes,
    "counters": {k: dict(v) for k, v in counters.items()},
}))
"""


def _load_again(run: Run, cache_root: Path, logits: Path) -> tuple[dict, str]:
    """A new process building the same engine over `cache_root`: its RESULT and its log."""
    env = checkout_env() | {"DEEPINFER_CACHE": str(cache_root)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the engine's default: under deepinfer's
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_AGAIN, str(run.checkpoint), str(logits)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), out


def _compiled_nothing(result: dict) -> bool:
    """Dynamo traced no graph, AOTAutograd saw none, inductor looked none up in its caches
    (a loaded graph replays inductor's other counters, as a cache hit does)."""
    counters = result["counters"]
    return not (
        counters.get("stats", {}).get("unique_graphs")
        or counters.get("aot_autograd")
        or any(k.startswith("fxgraph_cache") for k in counters.get("inductor", {}))
    )


# one architecture: the saved-graph path is the same for all (Qwen3's has all three graphs)
@pytest.mark.parametrize("runs", ["qwen3"], indirect=True)
def test_a_new_process_loads_the_saved_graphs_and_compiles_nothing(
    runs: tuple[Run, Run], cache_root: Path, tmp_path: Path
) -> None:
    compiled = runs[1]
    result, _ = _load_again(compiled, cache_root, tmp_path / "logits.pt")
    assert result["artifacts"] == str(compiled.artifacts)
    assert result["loaded"] == 3 and not result["failed"]
    assert _compiled_nothing(result), result["counters"]
    # inductor's vector-ISA probes answered as the compile ran them, none run again
    assert (compiled.artifacts / ISA_FILE).is_file() and result["isa_probes"] == []
    assert torch.equal(torch.load(tmp_path / "logits.pt"), compiled.probe)


_FRESH_PROBES = """
import json
from torch._inductor import cpu_vec_isa
from daemon.models.compiled_artifacts import _isa_probes
record = {}
with _isa_probes(record, replay=False):
    cpu_vec_isa.valid_vec_isa_list()
print("KEYS", json.dumps(sorted(record)))
"""


def test_the_probe_record_holds_the_probes_a_new_process_asks_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a process whose probes ran before its compile (another model's, an earlier test's),
    the record is completed with them under the keys a new process looks up: found flags
    (avx512's bf16) change an ISA's build flags, which key the probes."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()  # run and cached here, as by an earlier compile
    record: dict[str, bool] = {}
    _probe_again(record)
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROBES],
        cwd=ROOT,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("KEYS "))
    fresh = json.loads(line.removeprefix("KEYS "))
    assert fresh and set(fresh) <= set(record), (fresh, sorted(record))
    # and a complete record answers them all: nothing runs again
    ran: list[str] = []
    real = cpu_vec_isa.VecISA._probe_load
    spy = lambda isa, path: ran.append(str(isa)) or real(isa, path)  # noqa: E731
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", spy)
    _probe_again(record)
    assert ran == []


@pytest.mark.parametrize("runs", ["qwen3"], indirect=True)
def test_a_corrupt_or_mismatched_saved_graph_is_compiled_again(
    runs: tuple[Run, Run], cache_root: Path, tmp_path: Path
) -> None:
    """One file cut short (it does not load), another a valid graph of the wrong function
    (it loads, then refuses the warm-up's inputs): the engine compiles them again, serves the
    same logits, and saves them anew."""
    compiled = runs[1]
    saved = compiled.artifacts
    assert saved is not None and saved.is_relative_to(cache_root)
    files = {
        name: saved / f"{name}.bin" for name in ("decode_layer", "attention_in", "attention_out")
    }
    files["decode_layer"].write_bytes(files["decode_layer"].read_bytes()[:1000])
    files["attention_out"].write_bytes(files["attention_in"].read_bytes())
    result, log = _load_again(compiled, cache_root, tmp_path / "logits.pt")
    assert "compiled_artifact_unusable" in log and "compiled_artifacts_failed" in log
    assert result["loaded"] == 0 and not result["failed"]
    assert torch.equal(torch.load(tmp_path / "logits.pt"), compiled.probe)
    # saved anew: whole, each its own
    assert files["decode_layer"].stat().st_size > 1000
    assert files["attention_out"].read_bytes() != files["attention_in"].read_bytes()


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
