"""Speculative decoding through the daemon: a server with `--speculative ngram` answers the
openai SDK as one without it does (greedy and seeded, whole and streamed, logprobs), and
reports its drafts in /metrics and /health; the settings that turn it on."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.service.live_server import LiveServer
from daemon.service.settings import ConfigError, load_settings
from tests.conftest import TINY_MAX_MODEL_LEN, TINY_SERVED_NAME

NO_EOS = {"ignore_eos": True}
PROMPT = "the cat sat on the mat and"


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    engine_cfg = EngineConfig(
        model=str(tiny_model_dir),
        served_model_name=TINY_SERVED_NAME,
        overlap=True,
        kv_cache_memory_gb=0.05,
        max_num_seqs=16,
        max_model_len=TINY_MAX_MODEL_LEN,
        speculative="ngram",
        spec_policy="fixed",  # every draft verified: the adaptive one is built in test_spec_engine
        block_size=4,
    )
    server_cfg = ServerConfig(host="127.0.0.1", port=0, max_body_bytes=1 << 20, shutdown_timeout=2)
    server = LiveServer(engine_cfg, server_cfg)
    server.start()
    yield server
    server.stop()


def get(server: LiveServer, path: str) -> str:
    with urllib.request.urlopen(server.url + path, timeout=10) as r:
        return r.read().decode()


def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


# three tokens far above the rest: the output runs over them, as the model's own logits
# choose, so it repeats itself and a prompt lookup drafts from it (some drafts right, some not)
BIAS = {"extra_body": NO_EOS | {"logit_bias": {"1000": 30, "2000": 30, "3000": 30}}}


def test_answers_equal_a_server_without_speculation(api_server, spec_server) -> None:
    plain, spec = client(api_server), client(spec_server)
    for args in (
        dict(temperature=0.0, max_tokens=40, logprobs=2),
        dict(temperature=0.9, top_p=0.95, max_tokens=32, seed=11, n=2),
    ):
        a = plain.completions.create(model=api_server.model, prompt=PROMPT, **BIAS, **args)
        b = spec.completions.create(model=spec_server.model, prompt=PROMPT, **BIAS, **args)
        assert [c.text for c in b.choices] == [c.text for c in a.choices]
        assert b.usage.completion_tokens == a.usage.completion_tokens
        if args.get("logprobs"):
            la, lb = a.choices[0].logprobs, b.choices[0].logprobs
            assert lb.tokens == la.tokens
            assert lb.token_logprobs == pytest.approx(la.token_logprobs, abs=1e-4)
    streamed = spec.completions.create(
        model=spec_server.model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0.0,
        stream=True,
        **BIAS,
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    whole = spec.completions.create(
        model=spec_server.model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0.0,
        **BIAS,
    )
    assert text == whole.choices[0].text


def test_drafts_in_metrics_and_health(spec_server) -> None:
    client(spec_server).completions.create(
        model=spec_server.model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0.0,
        **BIAS,
    )
    health = json.loads(get(spec_server, "/health"))
    assert health["spec_drafter"] == "ngram" and health["spec_policy"] == "fixed"
    assert health["spec_drafts"] > 0 and health["spec_draft_tokens"] >= health["spec_drafts"]
    assert 0 < health["spec_accepted_tokens"] < health["spec_draft_tokens"]
    assert health["spec_mean_accepted_length"] >= 1.0
    assert len(health["spec_acceptance_by_position"]) >= 1
    # the calibration: each verified draft's accepted positions and its first rejected one
    bins = health["spec_calibration"]
    assert bins and all(0.0 <= b["lo"] < b["hi"] <= 1.0 and b["trials"] > 0 for b in bins)
    assert sum(b["accepted"] for b in bins) == health["spec_accepted_tokens"]
    rejected = sum(b["trials"] - b["accepted"] for b in bins)
    assert 0 < rejected <= health["spec_drafts"]
    assert all(b["lo"] <= b["expected"] <= b["hi"] for b in bins)
    assert health["kv_blocks_free"] == health["kv_blocks_total"]
    text = get(spec_server, "/metrics")
    lines = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(lines["deepinfer:spec_decode_num_drafts_total"]) == health["spec_drafts"]
    assert (
        float(lines["deepinfer:spec_decode_num_accepted_tokens_total"])
        == health["spec_accepted_tokens"]
    )
    assert 'deepinfer:spec_decode_acceptance_by_position{position="0"}' in lines
    assert float(lines["deepinfer:spec_decode_mean_accepted_length"]) >= 1.0
    assert "deepinfer:spec_decode_budget_last" in lines


def test_settings_turn_it_on_from_file_environment_and_flags(tmp_path: Path) -> None:
    from daemon.service.cli import build_parser
    from daemon.service.flags import settings_from

    off = load_settings().engine
    assert (off.speculative, off.num_speculative_tokens, off.spec_policy) == (None, 5, "adaptive")
    path = tmp_path / "node.toml"
    path.write_text("[engine]\nspeculative = 'suffix'\nnum_speculative_tokens = 3\n")
    assert load_settings(path).engine.speculative == "suffix"
    env = {"DEEPINFER_ENGINE_SPECULATIVE": "ngram", "DEEPINFER_ENGINE_SPEC_POLICY": "fixed"}
    e = load_settings(path, env).engine
    assert (e.speculative, e.num_speculative_tokens, e.spec_policy) == ("ngram", 3, "fixed")
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(path),
            "--num-speculative-tokens",
            "7",
            "--spec-policy",
            "adaptive",
        ]
    )
    e = settings_from(args).engine
    assert (e.speculative, e.num_speculative_tokens, e.spec_policy) == ("suffix", 7, "adaptive")
    for bad, key in (
        ({"DEEPINFER_ENGINE_SPECULATIVE": "eagle"}, "engine.speculative"),
        ({"DEEPINFER_ENGINE_SPEC_POLICY": "always"}, "engine.spec_policy"),
        ({"DEEPINFER_ENGINE_NUM_SPECULATIVE_TOKENS": "0"}, "engine.num_speculative_tokens"),
    ):
        with pytest.raises(ConfigError) as err:
            load_settings(env=bad)
        assert err.value.key == key
