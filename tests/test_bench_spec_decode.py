"""`python -m bench.spec_decode` wired end to end against our own server (a tiny random
checkpoint with a chat template, a tiny grid), and its parts: the workloads, the counters read
around a run, the ratios against issue 20's targets."""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.spec import report, workloads
from bench.spec.counters import SpecCounters, spec_samples
from bench.spec_decode import arm_order, main
from tests.checkpoints import make_dense_checkpoint

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROSE = (
    "The engine loop schedules a step, prepares it and hands it to the device worker.\n"
    "While that step runs, the loop processes the previous one.\n"
    "A request that finishes leaves its blocks in the prefix cache for later requests.\n\n"
    "Blocks are written to the store as soon as they exist. A file that fails a check is a "
    "miss and is removed, never wrong KV. Reads past the timeout are misses too.\n"
    "The sweeper drops blocks past their retention, then the oldest above the watermark.\n"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_dense_checkpoint(
        tmp_path_factory.mktemp("tiny-spec-bench"),
        with_tokenizer=True,
        max_position_embeddings=2048,
    )
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": TEMPLATE}))
    return path


def _count(text: str) -> int:
    return len(text.split())


def test_passages_cut_at_lines_and_sentences(tmp_path: Path) -> None:
    f = tmp_path / "prose.txt"
    f.write_text(PROSE)
    ps = workloads.cut_passages([f], _count, 20)
    assert len(ps) >= 3 and all(p.source == "prose.txt" for p in ps)
    assert all(p.tokens >= 10 for p in ps)  # a last piece under half the target is dropped
    joined = "\n".join(p.text for p in ps)
    # every passage is the file's own text: whole lines, or a long line's whole sentences
    assert all(line in PROSE for p in ps for line in p.text.splitlines())
    assert "A file that fails a check is a miss and is removed, never wrong KV." in joined


def test_typos_swap_letters_inside_words() -> None:
    text = "Speculative decoding verifies several drafted tokens in one forward step " * 10
    typo = workloads.with_typos(text, random.Random(1), rate=0.3)
    assert typo != text and len(typo) == len(text)
    words, typo_words = text.split(), typo.split()
    changed = [(a, b) for a, b in zip(words, typo_words, strict=True) if a != b]
    assert changed and all(sorted(a) == sorted(b) and a[0] == b[0] for a, b in changed)


def test_requests_seeded_and_split_without_repeats(tmp_path: Path) -> None:
    f = tmp_path / "prose.txt"
    f.write_text(PROSE)
    ps = workloads.cut_passages([f], _count, 20)
    edit = workloads.edit_requests(ps, 0, 64)
    assert len(edit) == len(ps) * len(workloads.INSTRUCTIONS)
    assert [r.line() for r in edit] == [r.line() for r in workloads.edit_requests(ps, 0, 64)]
    assert [r.line() for r in edit] != [r.line() for r in workloads.edit_requests(ps, 1, 64)]
    chat = workloads.chat_requests(0, 64)
    assert len(chat) == len(workloads.QUESTIONS) * len(workloads.STYLES) and len(chat) >= 64 * 3
    assert len({r.line() for r in chat}) == len(chat)
    a, b = workloads.split(chat, [3, 5], "chat")
    assert (len(a), len(b)) == (3, 5) and not {r.line() for r in a} & {r.line() for r in b}
    with pytest.raises(workloads.WorkloadError, match="needs 100 distinct"):
        workloads.split(chat[:10], [50, 50], "chat")
    line = json.loads(edit[0].line())
    assert line["max_tokens"] == 64 and line["messages"][0]["role"] == "user"


def test_shared_texts_found_above_the_checkout(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    (tmp_path / "shared" / "seeds").mkdir(parents=True)
    (tmp_path / "shared" / "docs").mkdir()
    (tmp_path / "shared" / "seeds" / "a.txt").write_text("x")
    (tmp_path / "shared" / "docs" / "b.md").write_text("y")
    found = workloads.shared_texts(tmp_path / "wt" / "bench")
    assert [p.name for p in found] == ["a.txt", "b.md"]
    assert workloads.shared_texts(tmp_path_factory.mktemp("no-shared")) == []


def _exposition(scale: float) -> str:
    """/metrics text as the server's collector writes it (prometheus_client), counts * scale."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    totals = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 20}
    totals |= {"budget_tokens": 40, "budget_steps": 5}

    class Spec:
        def collect(self) -> Iterator[object]:
            for name, v in totals.items():
                yield CounterMetricFamily(f"deepinfer:spec_decode_{name}", "", value=v * scale)
            for name, vs in (("accepted", [8, 6, 4, 2]), ("verified", [10, 10, 10, 10])):
                fam = CounterMetricFamily(
                    f"deepinfer:spec_decode_num_{name}_tokens_per_pos", "", labels=["position"]
                )
                for j in (3, 0, 1, 2):  # any order
                    fam.add_metric([str(j)], vs[j] * scale)
                yield fam
            yield GaugeMetricFamily("deepinfer:spec_decode_acceptance_rate", "", value=0.5)
            yield CounterMetricFamily("deepinfer:steps", "", value=3)

    registry = CollectorRegistry()
    registry.register(Spec())
    return generate_latest(registry).decode()


def test_counters_difference_and_sum() -> None:
    calibration = [
        {"lo": 0.0, "hi": 0.5, "trials": 4, "accepted": 1, "confidence_sum": 1.0},
        {"lo": 0.5, "hi": 1.0, "trials": 6, "accepted": 5, "confidence_sum": 4.5},
    ]
    samples = spec_samples(_exposition(3.0))
    assert "deepinfer:spec_decode_acceptance_rate" not in samples  # gauges: no difference
    assert "deepinfer:steps_total" not in samples
    before = SpecCounters.of(spec_samples(_exposition(2.0)), {"status": "ok"})
    after = SpecCounters.of(samples, {"status": "ok", "spec_calibration": calibration})
    d = after.minus(before)
    assert d.present and (d.drafts, d.draft_tokens, d.accepted_tokens) == (10, 40, 20)
    assert d.mean_accepted_length == 3.0 and d.acceptance_rate == 0.5 and d.budget_mean == 8.0
    assert d.verified == [10, 10, 10, 10] and d.by_position() == [0.8, 0.6, 0.4, 0.2]
    assert [(b.expected, b.observed) for b in d.bins] == [(0.25, 0.25), (0.75, 5 / 6)]
    key = 'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'
    assert d.metrics[key] == 8.0 and after.metrics[key] == 24.0
    both = SpecCounters.from_json(d.to_json()).plus(d)
    assert (both.drafts, both.verified, both.bins[1].trials) == (20, [20, 20, 20, 20], 12)
    none = SpecCounters.of(spec_samples("# TYPE deepinfer:steps counter\n"), {"status": "ok"})
    assert not none.present and none.mean_accepted_length is None and none.by_position() == []


def _run(workload: str, arm: str, conc: int, rep: int, tok_s: float) -> dict:
    summary = {
        "completed": 4,
        "failed": 0,
        "output_throughput": tok_s,
        "ttft_ms": {"median": 10.0, "p99": 20.0},
        "tpot_ms": {"median": 5.0, "p99": 6.0},
    }
    spec = SpecCounters(present=arm != "none")
    if arm != "none":
        spec.drafts, spec.draft_tokens, spec.accepted_tokens = 4, 12, 6
        spec.verified, spec.accepted = [4, 4, 4], [3, 2, 1]
    return {"workload": workload, "arm": arm, "concurrency": conc, "repeat": rep,
            "summary": summary, "spec": spec.to_json()}  # fmt: skip


def test_ratios_against_the_targets() -> None:
    """Medians over repeats; adaptive / fixed averaged over the grid; the lowest adaptive /
    none; (a) at concurrency 1."""
    tok_s = {  # (workload, conc) -> none, fixed, adaptive
        ("edit", 1): (10.0, 14.0, 16.0),
        ("edit", 8): (50.0, 55.0, 60.0),
        ("chat", 1): (10.0, 11.0, 11.0),
        ("chat", 8): (50.0, 40.0, 49.0),
    }
    runs = [
        _run(w, arm, c, rep, v * (1.0 + 0.1 * rep) if rep < 2 else v * 5)
        for (w, c), vs in tok_s.items()
        for arm, v in zip(report.ARMS, vs, strict=True)
        for rep in range(3)
    ]
    ps = report.points(runs)
    assert [(p.workload, p.concurrency, p.arm) for p in ps[:3]] == [
        ("edit", 1, "none"),
        ("edit", 1, "fixed"),
        ("edit", 1, "adaptive"),
    ]
    by = {(p.workload, p.concurrency, p.arm): p for p in ps}
    assert by[("edit", 1, "adaptive")].output_tok_s == pytest.approx(16.0 * 1.1)  # the median
    assert by[("edit", 1, "adaptive")].vs_none == pytest.approx(1.6)
    assert by[("edit", 1, "none")].vs_none is None and by[("edit", 1, "fixed")].vs_fixed is None
    assert by[("edit", 1, "fixed")].mean_accepted_length == pytest.approx(1 + 18 / 12)
    v = report.verdict(ps)
    assert v.adaptive_vs_fixed_mean == pytest.approx((16 / 14 + 60 / 55 + 1.0 + 49 / 40) / 4)
    assert v.adaptive_vs_none_min == pytest.approx(0.98) and v.adaptive_vs_none_min_at == "chat c8"
    assert v.edit_c1_vs_none == pytest.approx(1.6)
    # every repeat scaled the arms alike: each repeat's ratio is the ratio of the medians
    assert by[("edit", 1, "adaptive")].vs_none_paired == pytest.approx(1.6)
    assert by[("chat", 8, "adaptive")].vs_fixed_paired == pytest.approx(49 / 40)
    assert v.paired is not None and v.paired.adaptive_vs_none_min == pytest.approx(0.98)
    lines = v.lines()
    assert [line.endswith(": met)") for line in lines[:6]] == [True, False, True] * 2
    assert "paired" not in lines[2] and "paired" in lines[3]
    assert lines[6].endswith("– (an interval needs 6 repeats or more)")  # three ran
    md = report.markdown(runs)
    assert "| edit | 1 | adaptive | 17.6 | 1.60× | 1.14× |" in md
    # over both concurrencies and the three repeats: 3 of 4 accepted at position 1, 4 verified
    assert "| edit | fixed k=5 | 75.0% (24) | 50.0% (24) | 25.0% (24) |" in md
    assert "calibration: the servers reported no calibration bins" in md


MAX_TOKENS = 24
# three tokens far above the rest (as tests/test_spec_api.py does): the random model's answers
# run over them and repeat themselves, so a prompt lookup drafts from them
BIAS = json.dumps({"logit_bias": {"1000": 30, "2000": 30, "3000": 30}})


def test_paired_ratios_are_the_median_of_each_repeats_ratio() -> None:
    """A slow spell of the machine in one repeat slows both arms of it: the ratio of the
    medians (90 / 100) reads it as a loss, the median of each repeat's ratio (1.1, 1.1,
    0.75) does not."""
    none, adaptive = (100.0, 60.0, 120.0), (110.0, 66.0, 90.0)
    runs = [
        _run("chat", arm, 8, rep, tok_s[rep])
        for arm, tok_s in (("none", none), ("adaptive", adaptive))
        for rep in range(3)
    ]
    (_, p) = report.points(runs)
    assert p.vs_none == pytest.approx(0.9) and p.vs_none_paired == pytest.approx(1.1)
    assert p.vs_fixed_paired is None  # no fixed arm ran
    v = report.verdict([p])
    assert v.adaptive_vs_none_min == pytest.approx(0.9)
    assert v.paired is not None and v.paired.adaptive_vs_none_min == pytest.approx(1.1)
    assert v.paired.paired is None
    assert "| chat | 8 | adaptive | 90.0 | 0.90× | – | 1.10× | – |" in report.markdown(runs)


def test_median_interval_by_the_sign_test() -> None:
    """Ten ratios: P(Binomial(10, 1/2) <= 1) = 11 / 1024, so [x_(2), x_(9)] holds the median
    with 1 - 2 * 11 / 1024 = 97.9 % (x_(3) would give 89 %); five have no 95 % interval (the
    whole range holds it with 1 - 2 / 32 = 94 %)."""
    xs = [1.0 + i / 100 for i in (5, 0, 9, 2, 7, 1, 8, 3, 6, 4)]
    assert report.median_interval(xs) == (1.01, 1.08)
    assert report.median_interval(xs[:5]) is None
    assert report.median_interval(xs[:6]) == (1.0, 1.09)
    assert report.median_interval(xs[:5], level=0.9) == (1.0, 1.09)


def test_points_below_none_beyond_the_noise() -> None:
    """Six repeats each: chat c8's ratios all sit under 1.0 (its interval too), chat c32's
    straddle it (a median under 1.0 that the noise explains)."""
    low = (0.95, 0.97, 0.96, 0.94, 0.98, 0.93)
    mixed = (0.97, 1.03, 0.98, 1.02, 0.96, 1.01)
    runs = [
        _run("chat", arm, c, rep, 100.0 * (ratios[rep] if arm == "adaptive" else 1.0))
        for c, ratios in ((8, low), (32, mixed))
        for arm in ("none", "adaptive")
        for rep in range(6)
    ]
    ps = report.points(runs)
    by = {(p.concurrency, p.arm): p for p in ps}
    assert by[(8, "adaptive")].vs_none_interval == pytest.approx((0.93, 0.98))
    assert by[(32, "adaptive")].vs_none_interval == pytest.approx((0.96, 1.03))
    v = report.verdict(ps)
    assert v.paired is not None and v.paired.below_none == ["chat c8"]
    assert v.below_none is None  # the ratios of the medians have no interval
    assert "**chat c8** of 2 (target: none: NOT met)" in v.lines()[-1]
    assert "| 0.93–0.98× |" in report.markdown(runs)
    runs = [r for r in runs if r["repeat"] < 5]
    assert "needs 6 repeats" in report.verdict(report.points(runs)).lines()[-1]


def test_arm_order_rotates_by_point_and_repeat() -> None:
    arms = ["none", "fixed", "adaptive"]
    assert arm_order(arms, 0, 0) == arms
    assert arm_order(arms, 0, 1) == ["fixed", "adaptive", "none"]
    assert arm_order(arms, 1, 1) == ["adaptive", "none", "fixed"]
    firsts = [arm_order(arms, r, p)[0] for r in range(2) for p in range(6)]
    assert all(firsts.count(a) == 4 for a in arms)


def test_end_to_end(chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The grid on a tiny model: every arm's server, both workloads, two concurrencies;
    greedy, so every request's answer has as many tokens with speculation as without."""
    arms = list(report.ARMS)
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    out = tmp_path / "run"
    rc = main(
        ["--model", str(chat_model), "--dtype", "float32", "--arms", *arms]
        + ["--concurrency", "1", "2", "--repeats", "1", "--min-requests", "2"]
        + ["--requests-per-slot", "1", "--max-tokens", str(MAX_TOKENS), "--passage-tokens", "24"]
        + ["--texts", str(text), "--warmup", "1", "--out", str(out), "--extra-body", BIAS]
        + ["--server-args", "--kv-cache-memory-gb 0.05 --max-model-len 1024 --max-num-seqs 4"]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    data = json.loads((out / "spec.json").read_text())
    grid = [(w, c) for w in ("edit", "chat") for c in (1, 2)]
    assert [(r["arm"], r["workload"], r["concurrency"]) for r in data["runs"]] == [
        (arm, w, c) for i, (w, c) in enumerate(grid) for arm in arm_order(arms, 0, i)
    ]
    assert [s["arm"] for s in data["started"]] == arms
    assert data["started"][0]["flags"] == [
        *("--kv-cache-memory-gb", "0.05", "--max-model-len", "1024", "--max-num-seqs", "4")
    ]
    lengths: dict[tuple[str, str, int], list[int]] = {}
    for r in data["runs"]:
        s = r["summary"]
        assert (s["completed"], s["failed"]) == (2, 0) and 0 < s["output_tokens"] <= 2 * MAX_TOKENS
        sent = json.loads(Path(r["result_json"]).read_text())
        assert sent["config"]["endpoint"] == "/v1/chat/completions"
        assert not sent["config"]["ignore_eos"]
        assert sent["config"]["max_concurrency"] == r["concurrency"]
        assert json.loads(sent["config"]["extra_body"]) == json.loads(BIAS)
        reqs = sorted(sent["requests"], key=lambda q: q["index"])
        lengths[r["workload"], r["arm"], r["concurrency"]] = [q["output_tokens"] for q in reqs]
        c = r["spec"]
        assert c["present"] == (r["arm"] != "none")
        # two /metrics families against each other: per position, and in all
        assert (
            sum(c["verified"]) == c["draft_tokens"] and sum(c["accepted"]) == c["accepted_tokens"]
        )
    # the runs of a server send disjoint requests, each of the workload it names
    lines = {
        (w, c): (out / "requests" / f"{w}-c{c}.jsonl").read_text().splitlines()
        for w in ("edit", "chat")
        for c in (1, 2)
    }
    assert all(len(v) == 2 for v in lines.values())
    assert not set(lines["edit", 1]) & set(lines["edit", 2])
    edit = [json.loads(x)["messages"][-1]["content"] for x in lines["edit", 1]]
    assert all(any(i in m for i in workloads.INSTRUCTIONS) for m in edit)
    chat = [json.loads(x)["messages"][-1]["content"] for x in lines["chat", 2]]
    assert all(m in workloads.QUESTIONS for m in chat)
    assert data["workloads"]["edit"]["by_source"]["prose.txt"]["passages"] >= 2
    table = (out / "table.md").read_text()
    assert table.count("| no speculation |") == 4 and table.strip() in printed
    # what each arm ran with, the adaptive arm's ceiling included
    assert "fixed: `--speculative ngram --num-speculative-tokens 5 --spec-policy fixed`" in table
    assert (
        "adaptive: `--speculative ngram --num-speculative-tokens 8 --spec-policy adaptive`" in table
    )
    names = [report.ARM_NAMES[a] for a in arms]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "spec.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for (w, arm, c), n in lengths.items():
        assert n == lengths[w, "none", c], (w, arm, c)
    fixed = [r["spec"] for r in data["runs"] if r["arm"] == "fixed"]
    assert sum(c["accepted_tokens"] for c in fixed) > 0
    assert all(0 < c["drafts"] <= c["draft_tokens"] <= 5 * c["drafts"] for c in fixed)
    assert data["verdict"]["adaptive_vs_fixed_mean"] is not None
    for w in ("edit", "chat"):
        assert all(f"| {w} | {c} | {name} |" in table for c in (1, 2) for name in names)
        assert f"| {w} | fixed k=5 | " in table  # its acceptance by position
