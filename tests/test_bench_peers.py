"""`python -m bench.peers` wired end to end against our own server only (a tiny random
checkpoint, a tiny workload): server start and teardown, runs, table, JSON and plot."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from bench.peers import report
from bench.peers.__main__ import main
from bench.peers.floor import Floor, checkpoint_params, measure
from bench.peers.servers import Launch, Server, ServerError
from daemon.service.live_server import free_port
from tests.checkpoints import make_dense_checkpoint

# A server that leaves a child in its group (as vLLM's engine core) and answers /v1/models.
FAKE = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"data": []}')
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_server_ready_and_whole_group_stopped(tmp_path: Path) -> None:
    port = free_port()
    launch = Launch("fake", [sys.executable, "-c", FAKE, str(port)], "fake")
    server = Server(launch, port, tmp_path / "fake.log")
    with server:
        assert server.wait_ready(30) < 30
        deadline = time.monotonic() + 10
        while "child" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(server.log_tail().split()[1])
        assert _alive(child)
    assert server.proc.poll() is not None
    deadline = time.monotonic() + 5  # init reaps the orphaned child after SIGKILL
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_server_that_exits_reports_its_log(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    server = Server(Launch("bad", argv, "bad"), port, tmp_path / "bad.log")
    with server, pytest.raises(ServerError, match="exited with 3(.|\n)*no such model"):
        server.wait_ready(30)


def test_deepinfer_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_dense_checkpoint(tmp_path / "tiny", with_tokenizer=True)
    out = tmp_path / "run"
    rc = main(
        ["--systems", "deepinfer", "--model", str(model), "--dtype", "float32"]
        + ["--concurrency", "1", "3", "--repeats", "2", "--num-prompts", "2", "3", "--warmup", "1"]
        + ["--input-len", "16", "--output-len", "4", "--out", str(out)]
        + ["--deepinfer-args", "--kv-cache-memory-gb 0.05 --max-model-len 256"]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    data = json.loads((out / "peers.json").read_text())
    assert [(r["repeat"], r["concurrency"]) for r in data["runs"]] == [
        (0, 1),
        (0, 3),
        (1, 1),
        (1, 3),
    ]
    assert [s["repeat"] for s in data["started"]] == [0, 1]
    assert [p.name for p in sorted(out.glob("kv-store-r*"))] == ["kv-store-r0", "kv-store-r1"]
    assert any(out.glob("kv-store-r0/**/*.kvb"))  # the store is on, as by default
    assert not any(_alive(s["pid"]) for s in data["started"])
    # every run of a started server sends fresh prompts (no prefix-cache hits across runs)
    configs = [json.loads(Path(r["result_json"]).read_text())["config"] for r in data["runs"]]
    assert len({c["seed"] for c in configs}) == 4
    for r, c in zip(data["runs"], configs, strict=True):
        assert c["max_concurrency"] == r["concurrency"] and c["ignore_eos"]
        s, n = r["summary"], 2 if r["concurrency"] == 1 else 3  # --num-prompts per concurrency
        assert (s["completed"], s["failed"]) == (n, 0)
        assert s["output_tokens"] == n * 4 and s["input_tokens"] == n * 16
        assert s["max_concurrency_seen"] <= r["concurrency"]
        assert s["cached_tokens"] == 0  # a fresh block store per server, fresh prompts per run
    rows = data["rows"]
    assert [(r["system"], r["concurrency"], r["repeats"]) for r in rows] == [
        ("deepinfer", 1, 2),
        ("deepinfer", 3, 2),
    ]
    for r in rows:
        assert r["output_tok_s"] > 0 and 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"]
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["ours_vs_tok_s"] == r["ours_vs_tpot"] == 1.0
    table = (out / "table.md").read_text()
    assert table.count("| deepinfer |") == 2 and "| deepinfer | 3 |" in table
    assert "| 1.00× | 1.00× | 3 / 0 |" in table and table.strip() in printed
    # the weight-read floor, measured in the run: fp32 weights at the copy rate
    floor = data["floor"]
    assert floor["copy_gb_s"] > 0 and floor["weight_bytes"]["float32"] == 4 * floor["params"]
    for r in rows:
        assert r["floor_tpot_ms"] == floor["tpot_ms"]["float32"] > 0
        assert r["tpot_vs_floor"] == pytest.approx(r["tpot_p50_ms"] / r["floor_tpot_ms"])
    assert "weight-read floor" in table and "float32" in table.splitlines()[-1]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not (out / "peers.png").exists() and "matplotlib not installed" in printed


def test_a_variant_runs_deepinfer_again_with_its_flags(tmp_path: Path) -> None:
    """`--variant bf16=...`: deepinfer once more as system deepinfer:bf16, after deepinfer in
    the repeat, with its flags last (its --dtype wins), its own block store, its rows against
    deepinfer's and the floor of the dtype it serves in."""
    model = make_dense_checkpoint(tmp_path / "tiny", with_tokenizer=True)
    out = tmp_path / "run"
    rc = main(
        ["--systems", "deepinfer", "--model", str(model), "--dtype", "float32"]
        + ["--variant", "bf16=--dtype bfloat16", "--concurrency", "2", "--repeats", "1"]
        + ["--num-prompts", "2", "--warmup", "0", "--input-len", "16", "--output-len", "4"]
        + ["--out", str(out), "--deepinfer-args", "--kv-cache-memory-gb 0.05 --max-model-len 256"]
    )
    assert rc == 0
    data = json.loads((out / "peers.json").read_text())
    assert [r["system"] for r in data["runs"]] == ["deepinfer", "deepinfer:bf16"]
    assert sorted(p.name for p in out.glob("kv-store-*")) == ["kv-store-bf16-r0", "kv-store-r0"]
    served = {
        log.name: [json.loads(line)["dtype"] for line in log.read_text().splitlines()
                   if '"model_loaded"' in line]
        for log in out.glob("*.log")
    }  # fmt: skip
    assert served == {
        "deepinfer-r0.log": ["torch.float32"],
        "deepinfer-bf16-r0.log": ["torch.bfloat16"],
    }
    rows = {r["system"]: r for r in data["rows"]}
    ours, variant = rows["deepinfer"], rows["deepinfer:bf16"]
    assert variant["ours_vs_tok_s"] == pytest.approx(ours["output_tok_s"] / variant["output_tok_s"])
    floor = data["floor"]["tpot_ms"]
    assert (ours["floor_tpot_ms"], variant["floor_tpot_ms"]) == (
        floor["float32"],
        floor["bfloat16"],
    )
    assert "| deepinfer:bf16 | 2 |" in (out / "table.md").read_text()


def test_variant_needs_a_label_and_flags(tmp_path: Path) -> None:
    for bad in ("--dtype float32", "a b=--no-kv-store"):
        with pytest.raises(SystemExit):
            main(["--systems", "deepinfer", "--model", str(tmp_path), "--variant", bad])


def test_peer_without_its_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--systems", "llamacpp", "--model", str(tmp_path)])


@pytest.mark.parametrize("tied", [True, False])
def test_floor_counts_the_weights_a_token_reads(tmp_path: Path, tied: bool) -> None:
    """Every tensor once; an untied input embedding only as a row lookup, so not at all."""
    from transformers import AutoModelForCausalLM

    path = make_dense_checkpoint(tmp_path, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(path)
    every = sum(p.numel() for p in model.parameters())  # a tied weight counted once
    embed = model.get_input_embeddings().weight.numel()
    params, dtype = checkpoint_params(path)
    assert dtype == "float32"
    assert params == (every if tied else every - embed)
    floor = measure(path, None, "bfloat16", repeats=3)
    assert floor is not None and floor.params == params
    assert floor.weight_bytes == {"bfloat16": 2 * params, "float32": 4 * params}
    for k, ms in floor.tpot_ms.items():
        assert ms == pytest.approx(1e3 * floor.weight_bytes[k] / (floor.copy_gb_s * 1e9))
    assert measure(path, None, "auto", repeats=3).weight_bytes["auto"] == 4 * params  # as stored


def test_rows_against_the_floor_of_what_each_system_reads(tmp_path: Path) -> None:
    floor = Floor(
        20.0,
        100,
        {"bfloat16": 200, "float32": 400, "gguf": 60},
        {"bfloat16": 10.0, "float32": 20.0, "gguf": 3.0},
    )
    summary = {
        "completed": 4,
        "failed": 0,
        "output_throughput": 50.0,
        "ttft_ms": {"median": 100.0, "p99": 120.0},
        "tpot_ms": {"median": 30.0, "p99": 40.0},
    }
    runs = [
        {"system": s, "concurrency": 1, "repeat": 0, "summary": summary}
        for s in ("deepinfer", "vllm", "llamacpp")
    ]
    rows = {r.system: r for r in report.rows(runs, floor, "bfloat16")}
    assert (rows["deepinfer"].floor_tpot_ms, rows["deepinfer"].tpot_vs_floor) == (10.0, 3.0)
    assert (rows["vllm"].floor_tpot_ms, rows["vllm"].tpot_vs_floor) == (10.0, 3.0)
    assert (rows["llamacpp"].floor_tpot_ms, rows["llamacpp"].tpot_vs_floor) == (3.0, 10.0)
    table = report.table(list(rows.values()))
    assert "| 4 / 0 | 10 ms | 3.00× |" in table and "| 4 / 0 | 3.0 ms | 10.00× |" in table
    assert report.rows(runs)[0].tpot_vs_floor is None  # no floor: no column values
    line = report.describe_floor(floor)
    assert "20.0 GB/s" in line and "gguf 0 MB -> 3.0 ms" in line
