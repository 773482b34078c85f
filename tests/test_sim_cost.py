"""The step-cost model's prefill part: with a table of steps of several chunks (`deepinfer
profile --prefill-batch`), a step pays its once-a-step part once and each chunk its own;
without one, the old guess (one decode step) stands; the table keeps it through JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.loop.request import Request, SamplingParams
from daemon.loop.scheduler import ScheduledSeq, SchedulerStep
from daemon.sim.cost import StepCost
from daemon.sim.table import CostTable, Grid, TableError
from tests.sim_traces import table

FIXED, PER_CHUNK = 0.05, 0.3  # what the batch rows below say at 256 tokens


def chunks(*sizes: int, decodes: int = 0) -> SchedulerStep:
    seqs = []
    for i, n in enumerate(sizes):
        req = Request(f"c{i}", [1] * n, SamplingParams(max_tokens=1))
        seqs.append(ScheduledSeq(req, 0, n, True, 0))
    for i in range(decodes):
        req = Request(f"d{i}", [1] * 100, SamplingParams(max_tokens=8))
        seqs.append(ScheduledSeq(req, 99, 1, True, 1))
    return SchedulerStep(seqs)


def batched() -> CostTable:
    """A table whose steps of k chunks of 256 tokens cost FIXED + k * PER_CHUNK (and of 16
    tokens, k times one chunk's: nothing paid once)."""
    t = table()
    one = FIXED + PER_CHUNK
    t.prefill = Grid([16, 256], [0, 8192], [[0.01, 0.02], [one, 2 * one]])
    t.prefill_batch = Grid([16, 256], [1, 8], [[0.01, 0.08], [one, FIXED + 8 * PER_CHUNK]])
    return t


def test_a_step_of_chunks_pays_the_once_a_step_part_once() -> None:
    cost = StepCost(batched())
    assert cost.fixed(256) == pytest.approx(FIXED)
    for k in (1, 3, 8):
        assert cost.seconds(chunks(*[256] * k)) == pytest.approx(FIXED + k * PER_CHUNK)
    assert cost.fixed(16) == pytest.approx(0.0)  # chunks that share nothing add up
    assert cost.seconds(chunks(16, 16, 16)) == pytest.approx(3 * 0.01)
    # beside decodes: the decode step, then each chunk less its once-a-step part
    decode = cost.decodes(2, 2 * 99)
    assert cost.seconds(chunks(256, decodes=2)) == pytest.approx(decode + PER_CHUNK)


def test_without_steps_of_several_chunks_the_old_guess_stands() -> None:
    t = batched()
    t.prefill_batch = None
    cost = StepCost(t)
    base = t.decode.at(1, 16)
    assert cost.fixed(256) == cost.base == pytest.approx(base)
    one = t.prefill.at(256, 0)
    assert cost.seconds(chunks(256, 256, 256)) == pytest.approx(one + 2 * (one - base))
    # and the measured rows price that step otherwise
    assert StepCost(batched()).seconds(chunks(256, 256, 256)) != pytest.approx(
        cost.seconds(chunks(256, 256, 256))
    )


def test_the_batch_rows_go_through_json(tmp_path: Path) -> None:
    t = batched()
    path = tmp_path / "t.json"
    t.save(path)
    assert CostTable.load(path) == t
    data = json.loads(path.read_text())
    data["prefill_batch"]["columns"] = [2, 8]  # no one-chunk column
    path.write_text(json.dumps(data))
    with pytest.raises(TableError, match="1 and more chunks"):
        CostTable.load(path)
    table().save(path)  # a table from before: no batch rows
    assert CostTable.load(path).prefill_batch is None
