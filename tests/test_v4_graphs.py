"""DeepSeek-V4 decode graphs: decode metadata padded to fixed shapes (idle rows, windows that
close nothing and their state all in scratch rows), the static-buffer path with an eager
stand-in for the capture on a CPU, a shape-only ("meta") run showing that a padded decode step
reads nothing back on the host (a CUDA graph could not hold such a read), and real replays
where a CUDA device exists."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.kv.spec import KVGroup
from daemon.loop import runner as runner_module
from daemon.loop.request import SamplingParams
from daemon.models.base import SeqSlice
from daemon.models.deepseek_v4.batch import DecodeShape
from daemon.models.deepseek_v4.blocks import MoE
from daemon.models.deepseek_v4.cache import V4Cache
from daemon.models.deepseek_v4.config import CSA, HCA, V4Config
from daemon.models.deepseek_v4.graphs import (
    V4Buckets,
    V4DecodeGraphs,
    V4StaticInputs,
    position_buckets,
)
from daemon.models.deepseek_v4.kv import V4Groups, kv_groups
from daemon.models.deepseek_v4.model import DeepseekV4ForCausalLM
from tests.checkpoints import V4_TINY, make_v4_checkpoint

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [3, 17, 40, 9, 26, 5]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4-graphs"))


def test_position_buckets_are_whole_blocks() -> None:
    assert position_buckets(128, 1000) == [128, 256, 512, 1024]
    assert position_buckets(8, 64) == [8, 16, 32, 64]


def _cache(
    num_blocks: int = 6, decode_shape: V4Buckets | None = None
) -> tuple[V4Config, V4Cache, list[KVGroup]]:
    from transformers import DeepseekV4Config

    cfg = V4Config.from_hf(DeepseekV4Config(**V4_TINY).to_dict())
    groups = kv_groups(cfg, torch.float32)
    cache = V4Cache(cfg, groups, [num_blocks] * len(groups), torch.device("cpu"), decode_shape)
    return cfg, cache, groups


def test_padded_decodes_write_idle_rows_to_scratch() -> None:
    cfg, cache, groups = _cache(decode_shape=V4Buckets(batches=[1, 4], positions=[8, 16, 32]))
    g = V4Groups.of(cfg, groups)
    # two requests at positions 11 (closes a CSA window: 12 % 4 == 0) and 14 (closes none)
    by_group = {
        g.swa: [[1], [2]],
        g.state: [[0], [3]],
        g.csa: [[4, 5], [1, 2]],
        g.hca: [[2, 3], [0, 5]],
    }
    csa_tables = by_group[g.csa]
    seqs = [
        SeqSlice(i, pos, 1, [by_group[k][i] for k in range(len(groups))], True)
        for i, pos in enumerate((11, 14))
    ]
    batch = cache.build_attention(seqs)
    shape = DecodeShape(batch=4, positions=16)
    d = batch.decodes
    assert batch.shape == shape and d.new_rows.shape == (4,)
    assert d.new_rows[2:].eq(cache.scratch_swa * cache.ring).all()
    assert d.window_padding[2:].all() and not d.window_padding[1, -1]
    assert d.state_blocks.tolist() == [0, 3, cache.scratch_state, cache.scratch_state]
    csa = d.entries[CSA]
    per_block = cache.per_block[CSA]
    assert csa.table.width == 16 // 4 and csa.counts.tolist() == [3, 3, 0, 0]
    assert csa.closing_mask.tolist() == [True, False, False, False]
    scratch_row = cache.scratch_block[CSA] * per_block
    assert csa.closed_rows.tolist() == [4 * per_block + 2] + [scratch_row] * 3
    # entries by block: request 0's blocks for the 16 // 4 entry slots, then its entry rows
    assert csa.table.blocks[0].tolist() == csa_tables[0][: -(-4 // per_block)]
    rows = [csa_tables[0][i // per_block] * per_block + i % per_block for i in range(3)]
    assert csa.table.rows(torch.arange(3).expand(4, 3))[0].tolist() == rows
    hca = d.entries[HCA]
    assert hca.counts.tolist() == [1, 1, 0, 0] and not hca.closing_mask.any()
    # the pool's block views leave the scratch rows out
    assert all(v.shape[0] == 6 for v in cache.block_views(g.csa))
    assert cache.layers[cfg.layers_of(CSA)[0]].entries.shape[0] == 7


def test_padded_decode_step_reads_nothing_back_on_the_host() -> None:
    """The whole padded decode forward on "meta" tensors, which hold no data: any .item(),
    .tolist(), data-dependent shape or host branch on a device value would raise."""
    from transformers import DeepseekV4Config

    cfg = V4Config.from_hf(DeepseekV4Config(**V4_TINY).to_dict())
    meta = torch.device("meta")
    with meta:
        model = DeepseekV4ForCausalLM(cfg, meta)
    groups = model.kv_groups(torch.float32, 0)
    cache = V4Cache(cfg, groups, [6] * len(groups), meta)
    for layer in model.modules():
        if isinstance(layer, MoE):
            layer.track_load = True
    for shape in (DecodeShape(4, 16), DecodeShape(8, 64)):  # dense and top-k CSA entries
        inputs = V4StaticInputs.allocate(shape, cache, meta)
        with torch.inference_mode():
            streams = model(inputs.input_ids, inputs.positions, inputs.attention(), cache)
        assert streams.shape == (shape.batch, cfg.hc_mult, cfg.hidden_size)


class EagerRecording(V4DecodeGraphs):
    """Everything of V4DecodeGraphs but the capture: a "replay" reruns the forward eagerly on
    the same static buffers into the same output tensor (after the same idle warm-up run)."""

    def record(self, inputs: V4StaticInputs):
        def forward() -> torch.Tensor:
            return self.model(inputs.input_ids, inputs.positions, inputs.attention(), self.cache)

        hidden = forward()
        return (lambda: hidden.copy_(forward())), hidden


async def _run(
    checkpoint: Path,
    device: str,
    graphs: type[V4DecodeGraphs] | None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> tuple:
    """(batched outputs, each prompt again alone, the shapes captured, MoE load per layer)."""
    if graphs is not None and device == "cpu":
        assert monkeypatch is not None  # the runner makes `graphs` on the CPU too
        monkeypatch.setattr(runner_module, "GRAPH_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(
            DeepseekV4ForCausalLM,
            "decode_graphs",
            lambda model, cache, device, max_batch: graphs(model, cache, device),
        )
    engine, _ = build_engine(
        EngineConfig(
            model=str(checkpoint),
            device=device,
            kv_cache_memory_gb=0.02,
            max_num_seqs=8,
            enforce_eager=graphs is None,
            overlap=True,
        )
    )
    runner = engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.track_load = True
    await engine.start()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]

    async def one(prompt: list[int]) -> list[int]:
        return [t async for out in engine.generate(prompt, GREEDY) for t in out.new_token_ids]

    try:
        batched = await asyncio.gather(*(one(p) for p in prompts))
        alone = [await one(p) for p in prompts]  # prefix-cache hits: resumed requests too
    finally:
        await engine.stop()
    loads = [layer.take_load().tolist() for layer in layers]
    return batched, alone, sorted(runner.graphs.graphs, key=str) if runner.graphs else [], loads


async def test_static_buffers_give_the_eager_tokens(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches shrink and grow across shapes, reusing buffers that larger batches filled; the
    idle rows must neither disturb real rows, nor write into the pool, nor count as expert load."""
    eager = await _run(checkpoint, "cpu", None)
    staged = await _run(checkpoint, "cpu", EagerRecording, monkeypatch)
    assert staged[0] == eager[0] and staged[1] == eager[1]
    assert staged[3] == eager[3]
    shapes = staged[2]
    assert len({s.batch for s in shapes}) > 1 and len({s.positions for s in shapes}) > 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_replay_equals_eager(checkpoint: Path) -> None:
    eager = await _run(checkpoint, "cuda", None)
    graphs = await _run(checkpoint, "cuda", V4DecodeGraphs)
    assert eager[2] == [] and len(graphs[2]) > 2
    assert graphs[0] == eager[0] and graphs[1] == eager[1] and graphs[3] == eager[3]
