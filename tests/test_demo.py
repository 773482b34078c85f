"""The built-in demo: a random-weight DeepSeek-V4 with the real V4 tokenizer, made once."""

from __future__ import annotations

import json

from daemon.build.config import EngineConfig
from daemon.build.demo import DEMO_NAME, ensure_demo_model
from daemon.build.engine import build_engine
from daemon.loop.request import SamplingParams


async def test_demo_is_a_deepseek_v4_that_serves(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    path = ensure_demo_model()
    assert ensure_demo_model() == path  # cached, not rebuilt
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["deepinfer_demo"]["random_weights"]
    engine, name = build_engine(EngineConfig(kv_cache_memory_gb=0.05, max_num_seqs=2))
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
