"""The step-cost profile at engine start (daemon/loop/spec_profile.py): real steps of tiny random
models through their runner, a table over the batch sizes that fit, the KV pool given back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.kv.manager import KVManager, pool_sizes
from daemon.loop import spec_profile
from daemon.loop.runner import ModelRunner
from daemon.loop.spec.cost import CostTable
from daemon.loop.spec_profile import CONTEXT, LONG_CONTEXT, _non_decreasing, profile
from daemon.models.checkpoints import make_dense_checkpoint, make_v4_checkpoint
from daemon.models.loader import load_model

CPU = torch.device("cpu")
MAX_SEQS = 5
BATCHED = 256


def _engine_parts(path: Path, memory: int = 0, tokens: int = 0) -> tuple[ModelRunner, KVManager]:
    """A runner and KV manager as build_engine makes them, over `memory` bytes of KV (or
    `tokens` positions of a dense model's)."""
    model = load_model(path, CPU, torch.float32).model
    groups = model.kv_groups(torch.float32, 16)
    memory = memory or int(tokens * sum(g.spec.bytes_per_block / g.spec.block_size for g in groups))
    runner = ModelRunner(model, groups, pool_sizes(groups, memory, MAX_SEQS), CPU, MAX_SEQS)
    return runner, KVManager(groups, memory, MAX_SEQS)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[ModelRunner, KVManager]:
    return _engine_parts(make_dense_checkpoint(tmp_path_factory.mktemp("llama")), tokens=8192)


def test_profile_measures_every_batch_size(dense, monkeypatch) -> None:
    runner, kv = dense
    free = [u.num_free for u in kv.usage()]
    state = runner.generator.get_state()
    prepare, verified = runner.prepare, []

    def watched(step, kv, ops):
        prepared = prepare(step, kv, ops)
        verified.append(0 if prepared.verify is None else len(prepared.verify.seqs))
        return prepared

    monkeypatch.setattr(runner, "prepare", watched)
    table = profile(runner, kv, MAX_SEQS, BATCHED, k=3, repeats=2, point_seconds=0.05)
    assert set(verified) == {0, 1, 4, 5}  # verify points: every sequence verifies its drafts
    assert [r.num_seqs for r in table.rows] == [1, 4, 5]
    for row in table.rows:
        s = row.num_seqs
        assert row.num_tokens == [s, 2 * s, 4 * s, BATCHED]  # 1, 2 and k + 1 tokens each
        assert all(t > 0 for t in row.seconds)
    # a row never falls as its steps grow (made so: under a loaded machine's noise a lone
    # decode can time as long as the prefill-sized step, so strictly more is not asserted)
    assert table.rows[0].seconds[-1] >= table.rows[0].seconds[0]
    assert table.seconds(BATCHED, 1) == pytest.approx(table.rows[0].seconds[-1])
    assert table.rollback_seconds >= 0 and table.device == "cpu"
    assert table.context == CONTEXT and table.context_seconds >= 0
    assert CostTable.from_json(table.to_json()) == table
    assert [u.num_free for u in kv.usage()] == free  # every block given back
    assert not kv.tables
    assert torch.equal(runner.generator.get_state(), state)  # sampling unaffected


def test_profile_leaves_out_batches_the_pool_cannot_hold(tmp_path) -> None:
    # 4 sequences of 128 + 4 positions fit 40 blocks of 16 tokens, 5 do not
    runner, kv = _engine_parts(make_dense_checkpoint(tmp_path), tokens=40 * 16)
    assert kv.capacity_tokens() == 40 * 16
    table = profile(runner, kv, MAX_SEQS, 96, k=3, repeats=1, point_seconds=0.05)
    assert [r.num_seqs for r in table.rows] == [1, 4]
    assert table.rows[0].num_tokens == [1, 2, 4, 96]
    assert table.seconds(25, 5) > 0  # extrapolated
    assert all(u.num_free == u.num_blocks for u in kv.usage())


def test_profile_prices_a_rows_context(tmp_path, monkeypatch) -> None:
    """Decode and verify steps at CONTEXT and LONG_CONTEXT positions give what a decode row and
    a draft row cost per position, on a quarter as many sequences where the pool cannot hold
    the batch that long (40 blocks: 4 sequences of 516 positions do not fit, 1 does)."""
    runner, kv = _engine_parts(make_dense_checkpoint(tmp_path), tokens=40 * 16)
    long_steps: list[tuple[int, int]] = []

    def timed(runner, kv, step, repeats, budget) -> float:
        # 1 ms a row; a position of context: 2 us a decode row, 0.5 us a draft row
        if any(s.start == LONG_CONTEXT for s in step.seqs):
            long_steps.append((len(step.seqs), sum(len(s.draft) for s in step.seqs)))
        return sum(
            1e-3 * s.num_tokens + (2e-6 + 5e-7 * len(s.draft)) * s.start
            for s in step.seqs
            if s.is_decode or s.draft
        )

    monkeypatch.setattr(spec_profile, "_time", timed)
    table = profile(runner, kv, MAX_SEQS, 96, k=3, repeats=1, point_seconds=0.05)
    assert long_steps == [(1, 0), (1, 3)]  # one sequence: a decode, then 3 drafts verified
    assert table.context == CONTEXT and table.context_seconds == pytest.approx(2e-6)
    assert table.draft_context_seconds == pytest.approx(5e-7)
    base = table.seconds(8, 4, 4)
    assert table.seconds(8, 4, 4, CONTEXT + 100) == pytest.approx(
        base + 100 * (4 * 2e-6 + 4 * 5e-7)
    )
    assert all(u.num_free == u.num_blocks for u in kv.usage())


def test_profile_times_the_rollback_of_per_request_state(tmp_path) -> None:
    runner, kv = _engine_parts(make_v4_checkpoint(tmp_path), 64 << 20)
    table = profile(runner, kv, 1, 64, k=1, repeats=1, point_seconds=0.05)
    assert [(r.num_seqs, r.num_tokens) for r in table.rows] == [(1, [1, 2, 64])]
    assert table.rollback_seconds > 0  # the ring and compressor state are copied
    assert all(u.num_free == u.num_blocks for u in kv.usage())


def test_profile_keeps_within_the_token_budget(dense) -> None:
    runner, kv = dense
    table = profile(runner, kv, MAX_SEQS, 12, k=3, repeats=1, point_seconds=0.05)
    # 1, 2 and 4 tokens a sequence where they fit 12, then the prefill-sized step
    assert [(r.num_seqs, r.num_tokens) for r in table.rows] == [
        (1, [1, 2, 4, 12]),
        (4, [4, 8, 12]),
        (5, [5, 10, 12]),
    ]
    assert all(u.num_free == u.num_blocks for u in kv.usage())


def test_rows_are_made_non_decreasing() -> None:
    assert _non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert _non_decreasing([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    assert _non_decreasing([1.0, 2.0]) == [1.0, 2.0]
