"""`deepinfer profile --quick` on the tiny random model writes a cost table that loads back;
`deepinfer simulate` runs a trace on it and writes its JSON result and PNG plots; bad input
gets a one-line error and exit status 2; the shipped CPU table says where and when."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.sim.commands import CPU_TABLE
from daemon.sim.cost import StepCost
from daemon.sim.profile import QUICK
from daemon.sim.table import CostTable, TableError
from tests.daemons import checkout_env

ROOT = Path(__file__).resolve().parents[1]


def deepinfer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon", *args],
        cwd=ROOT,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def quick_table(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "table.json"
    done = deepinfer(
        "profile", "--quick", "--model", str(tiny_model_dir), "--out", str(out),
        "--log-level", "warning", "--decode-seqs", "1,3", "--point-seconds", "0.02",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_profile_writes_a_table_that_loads_back(quick_table: Path, tmp_path: Path) -> None:
    table = CostTable.load(quick_table)
    p = table.provenance
    assert p.device == "cpu" and p.model.startswith("tiny-llama")  # the served name
    assert p.when.startswith("20") and "cores" in p.where and "profile --quick" in p.command
    assert table.prefill.rows == list(QUICK.prefill_tokens)
    assert table.decode.columns == list(QUICK.decode_context)
    assert table.decode.rows == [1, 3]  # --decode-seqs over the quick grid's
    assert table.kv.block_size == 16 and table.kv.num_layers == 2
    assert all(s > 0 for row in table.prefill.seconds + table.decode.seconds for s in row)
    assert table.store_read.latency_s > 0 and table.store_write.bytes_per_s > 0
    assert table.host_load.bytes_per_s > 0
    # steps of 1 and 2 chunks (the quick grid's) of each chunk size: the once-a-step part
    batch = table.prefill_batch
    assert batch is not None and batch.rows == [8, 32] and batch.columns == [1, 2]
    assert all(row[1] >= row[0] > 0 for row in batch.seconds)
    assert 0 <= StepCost(table).fixed(32) <= batch.seconds[1][0]
    # round trip: the same table again
    again = tmp_path / "again.json"
    table.save(again)
    assert CostTable.load(again) == table
    # interpolation stays within the measured range inside the grid
    g = table.decode
    mid = g.at((g.rows[0] + g.rows[-1]) / 2, g.columns[0])
    assert min(g.seconds[0][0], g.seconds[-1][0]) <= mid <= max(g.seconds[0][0], g.seconds[-1][0])
    assert StepCost(table).base == pytest.approx(g.seconds[0][0])


def test_profile_refuses_a_batch_axis_without_one_chunk(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    done = deepinfer(
        "profile", "--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path / "t.json"),
        "--prefill-batch", "2,4",
    )  # fmt: skip
    assert done.returncode == 2 and "--prefill-batch must be 1 and more" in done.stderr
    assert not (tmp_path / "t.json").exists()


def test_a_bad_table_is_refused(quick_table: Path, tmp_path: Path) -> None:
    data = json.loads(quick_table.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data | {"format": "something-else"}))
    with pytest.raises(TableError, match="not a deepinfer-sim-table-1"):
        CostTable.load(bad)
    data["decode"]["seconds"] = [[1.0]]
    bad.write_text(json.dumps(data))
    with pytest.raises(TableError, match="rows x columns"):
        CostTable.load(bad)


def trace_file(path: Path) -> Path:
    lines = []
    for i in range(40):
        ids = [0, 1] + [100 + i * 3 + k for k in range(i % 3 + 1)]
        n = 512 * (len(ids) - 1) + 37 * (i + 1) % 512 + 1
        lines.append(
            {"timestamp": 50 * i, "input_length": n, "output_length": 4 + i % 5, "hash_ids": ids}
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_simulate_writes_json_and_png(quick_table: Path, tmp_path: Path) -> None:
    trace = trace_file(tmp_path / "trace.jsonl")
    out = tmp_path / "result.json"
    done = deepinfer(
        "simulate", "--trace", str(trace), "--table", str(quick_table), "--nodes", "2",
        "--policy", "prefix-affinity", "--store-gb", "1", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["finished"] == 40 and result["rejected"] == 0
    assert result["ttft_s"]["p50"] > 0 and result["tpot_s"]["p99"] >= result["tpot_s"]["p50"]
    assert result["throughput"]["output_tok_s"] > 0
    assert 0 < result["prefix"]["hit_rate"] < 1  # blocks 0 and 1 are shared by all
    assert result["store_bytes"]["written"] > 0
    assert len(result["per_node"]) == 2 and result["timeline"]
    assert result["table"]["when"] == CostTable.load(quick_table).provenance.when
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0"], "--nodes must be at least 1"),
        (["--prefill", "2"], "--prefill and --decode go together"),
        (["--device-kv-gb", "inf"], "--device-kv-gb must be a positive number"),
        (["--trace", "/nonexistent/trace.jsonl"], "No such file"),
        (["--table", "/nonexistent/table.json"], "No such file"),
        (["--max-concurrency", "-1"], "--max-concurrency must be >= 0"),
        (["--request-ms", "-5"], "--request-ms must be a number >= 0"),
        (["--prefill-balance-rel", "0.5"], "--prefill-balance-rel / --prefill-balance-abs"),
    ],
)
def test_simulate_bad_input(args: list[str], message: str, tmp_path: Path) -> None:
    trace = trace_file(tmp_path / "trace.jsonl")
    base = {"--trace": str(trace), "--out": str(tmp_path / "r.json")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    done = deepinfer("simulate", *[x for kv in base.items() for x in kv])
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}\n')
    done = deepinfer("simulate", "--trace", str(trace), "--out", str(tmp_path / "r.json"))
    assert done.returncode == 2
    assert "trace.jsonl:1" in done.stderr and "cover fewer than 600" in done.stderr


def test_the_shipped_cpu_table_says_where_and_when() -> None:
    table = CostTable.load(CPU_TABLE)
    p = table.provenance
    assert p.device == "cpu" and "SmolLM2" in p.model and p.when.startswith("2026-")
    d = table.decode
    assert len(d.rows) > 2 and len(table.prefill.rows) > 2  # the full grid, not --quick
    assert d.seconds[-1][-1] > d.seconds[0][0]  # more sequences and context cost more
    assert table.prefill.seconds[-1][0] > 3 * table.prefill.seconds[0][0]
