"""`deepinfer bench serve` against the in-process test server: every dataset kind, the result
file, token counts with ignore_eos, and clean failures (unreachable URL, rejected request)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.benchmark.datasets import scaled_params, trace_sessions
from daemon.benchmark.metrics import percentile
from daemon.benchmark.traces import DEFAULTS
from daemon.service.cli import main
from tests.conftest import LiveServer
from tests.daemons import free_port

SMALL_TRACE = ["--length-scale", "0.03", "--turns", "2-3", "--time-scale", "0"]


def bench(server: LiveServer, out: Path, *args: str) -> dict:
    rc = main(
        ["bench", "serve", "--base-url", server.base_url, "--disable-tqdm", "--seed", "1"]
        + ["--result-json", str(out), *args]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["model"] == server.model
    return data


def turns_of(kind: str, sessions: int, vocab: int = 32000) -> int:
    params = scaled_params(DEFAULTS[kind], 0.03, (2, 3))
    return sum(len(s.turns) for s in trace_sessions(kind, sessions, 1, vocab, params))


def test_random_counts_and_result_file(api_server: LiveServer, tmp_path: Path) -> None:
    data = bench(
        api_server,
        tmp_path / "r.json",
        *("--num-prompts", "6", "--input-len", "32", "--output-len", "8", "--ignore-eos"),
        *("--max-concurrency", "3", "--goodput", "ttft:60000", "tpot:60000"),
    )
    s = data["summary"]
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["input_tokens"] == 6 * 32
    assert s["output_tokens"] == s["requested_output_tokens"] == 6 * 8
    assert s["good_requests"] == 6 and s["goodput"] > 0
    assert s["max_concurrency_seen"] <= 3
    assert s["ttft_ms"]["count"] == 6 and s["tpot_ms"]["count"] == 6
    assert s["itl_ms"]["count"] == 6 * 7  # one gap per streamed token after the first
    for r in data["requests"]:
        assert r["ok"] and r["counted_by"] == "usage"
        assert sum(r["chunk_tokens"]) == r["output_tokens"] == 8
        assert r["ttft_s"] <= r["e2e_s"]


def test_goodput_counts_only_requests_meeting_slos(api_server: LiveServer, tmp_path: Path) -> None:
    data = bench(
        api_server,
        tmp_path / "g.json",
        *("--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--ignore-eos"),
        *("--goodput", "ttft:0.001"),
    )
    assert data["summary"]["completed"] == 3
    assert data["summary"]["good_requests"] == 0 and data["summary"]["goodput"] == 0


def test_prefix_sharing_hits_the_cache(api_server: LiveServer, tmp_path: Path) -> None:
    data = bench(
        api_server,
        tmp_path / "p.json",
        *("--dataset", "prefix-sharing", "--prefix-len", "64", "--num-prefixes", "2"),
        *("--num-prompts", "6", "--input-len", "16", "--output-len", "4", "--ignore-eos"),
        *("--max-concurrency", "1"),
    )
    s = data["summary"]
    assert s["completed"] == 6 and s["output_tokens"] == 24
    assert s["input_tokens"] == 6 * 80
    assert s["cached_tokens"] >= 4 * 64  # every request after each prefix's first
    assert 0 < s["prefix_cache_hit_rate"] < 1


@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_multi_turn_traces(api_server: LiveServer, tmp_path: Path, kind: str) -> None:
    data = bench(
        api_server,
        tmp_path / f"{kind}.json",
        *("--dataset", kind, "--num-sessions", "2", "--ignore-eos", *SMALL_TRACE),
    )
    s = data["summary"]
    assert (s["completed"], s["failed"]) == (turns_of(kind, 2), 0)
    assert s["output_tokens"] == s["requested_output_tokens"]
    turns = sorted(data["requests"], key=lambda r: (r["session"], r["turn"]))
    for prev, cur in zip(turns, turns[1:]):
        if cur["session"] == prev["session"]:
            # the next prompt holds the previous prompt and its answer, and hits the cache
            assert cur["prompt_tokens"] > prev["prompt_tokens"] + prev["output_tokens"]
            assert cur["cached_tokens"] >= (prev["prompt_tokens"] // 16 - 1) * 16
    assert s["prefix_cache_hit_rate"] > 0


def test_trace_capped_by_num_prompts(api_server: LiveServer, tmp_path: Path) -> None:
    data = bench(
        api_server,
        tmp_path / "cap.json",
        *("--dataset", "chat", "--num-sessions", "3", "--num-prompts", "4", *SMALL_TRACE),
    )
    assert data["summary"]["completed"] == 4


def test_text_prompts(api_server: LiveServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    """--prompt-format text: text prompts, the history grows by the answer's text."""
    data = bench(
        api_server,
        tmp_path / "t.json",
        *("--dataset", "chat", "--num-sessions", "2", "--ignore-eos", *SMALL_TRACE),
        *("--prompt-format", "text", "--tokenizer", str(tiny_model_dir)),
    )
    s = data["summary"]
    assert s["completed"] > 0 and s["failed"] == 0
    assert s["output_tokens"] == s["requested_output_tokens"]


def test_plot(api_server: LiveServer, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    bench(
        api_server,
        tmp_path / "plot.json",
        *("--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--plot", str(png)),
    )
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_jsonl_requests_in_file_order(api_server: LiveServer, tmp_path: Path) -> None:
    """--dataset jsonl: each line once, in order, its own max_tokens or --output-len."""
    lines = [{"prompt": [5, 6, 7, 8], "max_tokens": 3}, {"prompt": "some text"}, {"prompt": [9]}]
    path = tmp_path / "req.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    data = bench(
        api_server,
        tmp_path / "j.json",
        *("--dataset", "jsonl", "--dataset-path", str(path), "--output-len", "5"),
        *("--ignore-eos", "--max-concurrency", "1"),
    )
    s = data["summary"]
    assert (s["completed"], s["failed"]) == (3, 0)
    reqs = sorted(data["requests"], key=lambda r: r["index"])
    assert [r["output_tokens"] for r in reqs] == [3, 5, 5]
    assert [reqs[0]["prompt_tokens"], reqs[2]["prompt_tokens"]] == [4, 1]
    assert reqs[1]["prompt_tokens"] > 0  # the server's count of the text
    capped = bench(
        api_server,
        tmp_path / "cap.json",
        *("--dataset", "jsonl", "--dataset-path", str(path), "--num-prompts", "2"),
    )
    assert capped["summary"]["completed"] == 2


@pytest.mark.parametrize(
    "line",
    ['{"prompt": []}', '{"messages": [{"content": "x"}]}', '{"prompt": "x", "max_tokens": 0}',
     '{"prompt": "x", "messages": []}', "[1, 2]", "{"],
)  # fmt: skip
def test_bad_jsonl_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    args = ["bench", "serve", "--dataset", "jsonl", "--dataset-path", str(path)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "Traceback" not in err


def test_unreachable_url_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--base-url", url, "--disable-tqdm"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and url in err and "Traceback" not in err
    assert main(["bench", "serve", "--base-url", url, "--model", "m", "--disable-tqdm"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_rejected_request_is_a_clear_error(
    api_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["bench", "serve", "--base-url", api_server.url, "--model", "nope", "--disable-tqdm"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "test request" in err and "HTTP 404" in err and "Traceback" not in err


def test_bad_flags() -> None:
    assert main(["bench", "serve", "--dataset", "chat", "--request-rate", "2"]) == 1
    assert main(["bench", "serve", "--duration", "5"]) == 1
    assert main(["bench", "serve", "--dataset", "jsonl"]) == 1  # no --dataset-path
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--goodput", "latency:5"])


def test_percentile_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 50, 90, 99, 100):
        assert percentile(sorted(values), q) == pytest.approx(np.percentile(values, q))
