"""CUDA graphs for decode steps: bucket choice, the scratch slot and the static-buffer path
everywhere (an eager stand-in for the capture on CPU); real replays equal to the eager forward
where a CUDA device exists."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.kv.spec import FullAttentionSpec
from daemon.loop.request import SamplingParams
from daemon.models.attention import PagedKVCache
from daemon.models.dense import DenseForCausalLM
from daemon.models.graphs import (
    PagedDecodeGraphs,
    StaticInputs,
    batch_buckets,
    bucket,
    width_buckets,
)
from tests.checkpoints import make_dense_checkpoint


def test_buckets_cover_every_size_once() -> None:
    sizes = batch_buckets(100)
    assert sizes[0] == 1 and sizes[-1] == 100 and sizes == sorted(set(sizes))
    assert [bucket(n, sizes) for n in (1, 3, 64, 65, 100)] == [1, 4, 64, 96, 100]
    assert bucket(101, sizes) is None
    widths = width_buckets(40)
    assert widths == [1, 2, 4, 8, 16, 32, 40]
    assert [bucket(n, widths) for n in (1, 5, 33, 40)] == [1, 8, 40, 40]


def test_scratch_slot_lies_outside_the_pool() -> None:
    spec = FullAttentionSpec(16, 2, torch.float32, 2, 8)
    cache = PagedKVCache(spec, num_blocks=5, device=torch.device("cpu"))
    assert cache.scratch_slot == 5 * 16
    assert cache.layers[0][0].shape[0] == 6 * 16  # the pool's blocks and one scratch block
    assert all(view.shape[0] == 5 for view in cache.block_views(0))


class EagerRecording(PagedDecodeGraphs):
    """Everything of PagedDecodeGraphs but the capture: a "replay" reruns the forward eagerly on the
    same static buffers into the same output tensor."""

    def record(self, inputs: StaticInputs):
        attention = inputs.attention()

        def forward() -> torch.Tensor:
            return self.model(inputs.input_ids, inputs.positions, attention, self.cache)

        hidden = forward()
        return (lambda: hidden.copy_(forward())), hidden


async def test_static_buffers_give_the_eager_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches that shrink and grow across buckets reuse buffers that earlier, larger batches
    filled; padded rows must neither disturb real rows nor write into the pool's blocks."""
    checkpoint = make_dense_checkpoint(tmp_path, "llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    eager = await _run(checkpoint, prompts, "cpu", None)
    staged = await _run(checkpoint, prompts, "cpu", EagerRecording, monkeypatch)
    assert staged[:2] == eager[:2]
    assert len({size for size, _ in staged[2]}) > 1 and len({w for _, w in staged[2]}) > 1


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [3, 17, 40, 64, 90, 5, 33, 120, 7]


async def _run(
    checkpoint: Path,
    prompts: list[list[int]],
    device: str,
    graphs: type[PagedDecodeGraphs] | None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> tuple:
    """(batched outputs, each prompt again alone, the graph keys captured)."""
    if graphs is not None and device == "cpu":  # the model's own on a CPU: the compiled forward
        assert monkeypatch is not None
        monkeypatch.setattr(
            DenseForCausalLM,
            "decode_graphs",
            lambda model, cache, device, max_batch: graphs(model, cache, device, max_batch),
        )
    engine, _ = build_engine(
        EngineConfig(
            model=str(checkpoint),
            device=device,
            kv_cache_memory_gb=0.05,
            max_num_seqs=16,
            enforce_eager=graphs is None,
        )
    )
    runner = engine.runner
    await engine.start()

    async def one(prompt: list[int]) -> list[int]:
        return [t async for out in engine.generate(prompt, GREEDY) for t in out.new_token_ids]

    try:
        batched = await asyncio.gather(*(one(p) for p in prompts))
        alone = [await one(p) for p in prompts]  # prefix-cache hits on the blocks written above
    finally:
        await engine.stop()
    return batched, alone, sorted(runner.graphs.graphs) if runner.graphs else []


@cuda
async def test_replay_equals_eager(tmp_path: Path) -> None:
    checkpoint = make_dense_checkpoint(tmp_path, "llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    eager = await _run(checkpoint, prompts, "cuda", None)
    graphs = await _run(checkpoint, prompts, "cuda", PagedDecodeGraphs)
    assert eager[2] == []
    assert len({size for size, _ in graphs[2]}) > 1 and len({w for _, w in graphs[2]}) > 1
    assert graphs[:2] == eager[:2]
    assert eager[0] == eager[1]
