"""The tiered prefix cache end to end: greedy outputs with the cache equal outputs without
it across a multi-turn conversation, with hits from device memory, host memory and the block
store, for a dense model and for DeepSeek-V4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.engine import Engine
from daemon.loop.request import Request, SamplingParams
from tests.checkpoints import make_dense_checkpoint, make_v4_checkpoint
from tests.mounts import fill, tmpfs

ANSWER = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FLOOD = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
TURNS = (45, 19, 27)  # new user tokens per turn


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> Path:
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4"))


async def engine_for(checkpoint: Path, **overrides) -> Engine:
    settings = dict(
        model=str(checkpoint),
        kv_cache_memory_gb=0.00025,
        max_num_seqs=4,
        max_num_batched_tokens=128,
        traffic_classes=["scratch=0"],
        overlap=True,
    )
    engine, _ = build_engine(EngineConfig(**(settings | overrides)))
    await engine.start()
    return engine


async def ask(engine: Engine, prompt: list[int], params=ANSWER, **kw) -> tuple[list[int], dict]:
    tokens, by_tier = [], {}
    req = engine.add_request(prompt, params, **kw)
    async for out in engine.stream(req):
        tokens += out.new_token_ids
        by_tier = out.cached_tokens_by_tier or by_tier
    return tokens, by_tier


async def flood(engine: Engine, vocab: int) -> None:
    """A request that needs every free device block: evicts all cached device blocks."""
    n = min(engine.kv.capacity_tokens(), engine.max_model_len) - 2
    prompt = torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(99)).tolist()
    await ask(engine, prompt, FLOOD, traffic_class="scratch")


async def conversation(engine: Engine, vocab: int, flood_before: set[int] = frozenset()):
    """Three turns, each prompt extending the last prompt and answer; returns per turn the
    answer and the cached tokens by tier."""
    g = torch.Generator().manual_seed(11)
    prompt: list[int] = []
    turns = []
    for i, n_new in enumerate(TURNS):
        prompt = prompt + torch.randint(2, vocab, (n_new,), generator=g).tolist()
        if i in flood_before:
            await flood(engine, vocab)
        answer, by_tier = await ask(engine, prompt)
        turns.append((answer, by_tier))
        prompt = prompt + answer
    return turns


async def run(checkpoint: Path, vocab: int, flood_before=frozenset(), **overrides):
    engine = await engine_for(checkpoint, **overrides)
    try:
        return await conversation(engine, vocab, flood_before), engine.stats()
    finally:
        await engine.stop()


def answers(turns) -> list[list[int]]:
    return [a for a, _ in turns]


@pytest.mark.parametrize("model", ["dense", "v4"])
async def test_every_tier_gives_the_same_outputs(model, request, tmp_path) -> None:
    checkpoint = request.getfixturevalue(model)
    vocab = 512
    # exact: on a V4 SWA miss resume only where the sliding window is stored (no replay)
    policy = dict(swa_miss_policy="exact")
    expected, _ = await run(checkpoint, vocab, prefix_caching=False)

    # device: turn 2 reuses turn 1 in place
    turns, stats = await run(checkpoint, vocab, **policy)
    assert answers(turns) == answers(expected)
    assert turns[1][1].get("device", 0) > 0 and stats["prefix_device_hits"] > 0

    # host: a flood evicts the device blocks before turn 3; they come back from host memory
    turns, stats = await run(checkpoint, vocab, {2}, **policy)
    assert answers(turns) == answers(expected)
    assert turns[2][1].get("host", 0) > 0 and stats["prefix_host_hits"] > 0
    assert stats["prefix_host_bytes_read"] > 0

    # store: no host tier; blocks written to files at compute time come back from the store
    store = tmp_path / "store"
    turns, stats = await run(
        checkpoint, vocab, {2}, host_cache_memory_gb=0, kv_store_dir=str(store), **policy
    )
    assert answers(turns) == answers(expected)
    assert turns[2][1].get("store", 0) > 0 and stats["prefix_store_hits"] > 0
    assert stats["kv_store_writes"] > 0 and stats["prefix_store_bytes_read"] > 0
    if model == "dense":
        # a fresh engine on the same store starts warm
        turns, stats = await run(checkpoint, vocab, kv_store_dir=str(store))
        assert answers(turns) == answers(expected)
        assert turns[0][1].get("store", 0) >= (TURNS[0] // 16) * 16 - 16


async def test_scratch_class_is_never_stored(dense, tmp_path) -> None:
    engine = await engine_for(dense, kv_store_dir=str(tmp_path / "store"))
    try:
        await flood(engine, 512)
        await engine.scheduler.prefix.store.flush()
        assert engine.stats()["kv_store_writes"] == 0
        await ask(engine, list(range(2, 60)))  # 58 + 12 tokens: 4 full blocks of 16
        await engine.scheduler.prefix.store.flush()
        assert engine.stats()["kv_store_writes"] == 4
    finally:
        await engine.stop()


async def test_cache_salt_separates_tenants(dense) -> None:
    engine = await engine_for(dense)
    try:
        prompt = list(range(2, 70))
        await ask(engine, prompt, cache_salt=b"tenant-a")
        _, same = await ask(engine, prompt, cache_salt=b"tenant-a")
        _, other = await ask(engine, prompt, cache_salt=b"tenant-b")
        assert same.get("device", 0) == 64 and not other
    finally:
        await engine.stop()


async def test_damaged_store_files_are_misses_not_errors(dense, tmp_path) -> None:
    store = tmp_path / "store"
    expected, _ = await run(dense, 512, prefix_caching=False)
    await run(dense, 512, kv_store_dir=str(store))
    files = sorted(store.rglob("*.kvb"))
    assert files
    for i, f in enumerate(files):
        raw = f.read_bytes()
        f.write_bytes([raw[: len(raw) // 2], raw[:-1] + bytes([raw[-1] ^ 1]), b"junk"][i % 3])
    turns, stats = await run(dense, 512, kv_store_dir=str(store))
    assert answers(turns) == answers(expected)
    assert stats["kv_store_bad_files"] > 0 and stats["prefix_store_hits"] == 0


async def test_full_store_disk_keeps_serving(dense, tmp_path) -> None:
    from prometheus_client import generate_latest

    from daemon.loop.metrics import EngineMetrics

    expected, _ = await run(dense, 512, prefix_caching=False)
    with tmpfs(tmp_path / "small", "size=64k") as root:
        fill(root)
        engine = await engine_for(dense, kv_store_dir=str(root / "store"))
        try:
            with capture_logs() as logs:
                turns = await conversation(engine, 512)
            stats = engine.stats()
            metrics = EngineMetrics()
            metrics.collect_engine(engine)
            scraped = generate_latest(metrics.registry).decode()
        finally:
            await engine.stop()
    assert answers(turns) == answers(expected)
    assert stats["kv_store_writes"] == 0
    assert len([e for e in logs if e["event"] == "kv_store_write_failed"]) == 1
    # /health (engine.stats) and /metrics count what was not written
    assert stats["kv_store_failed_writes"] >= 1 and stats["kv_store_dropped_writes"] > 0
    failed = f'deepinfer:kv_store_failures_total{{kind="failed_writes"}} {stats["kv_store_failed_writes"]:.1f}'
    assert failed in scraped, scraped
    assert 'deepinfer:kv_store_failures_total{kind="dropped_writes"}' in scraped


async def test_prefix_evicted_while_waiting_is_read_from_the_store(dense, tmp_path) -> None:
    """Blocks that were on the device when a request arrived but were evicted before it was
    admitted are read back from the store instead of recomputed."""
    engine = await engine_for(dense, host_cache_memory_gb=0, kv_store_dir=str(tmp_path / "s"))
    try:
        prompt = list(range(2, 60))  # 3 reusable blocks of 16
        await ask(engine, prompt)
        prefix = engine.scheduler.prefix
        await prefix.store.flush()
        req = Request("late", prompt + [7, 8], ANSWER)
        assert prefix.store_keys(req) == [] and req.prefix.store_checked == 3  # all on the device
        assert engine.kv.grow("flood", engine.kv.capacity_tokens())  # evicts every cached block
        engine.kv.free("flood")
        fetch = prefix.admit(req)
        assert fetch is not None and len(fetch) == 3
        prefix.receive(req, fetch, await prefix.store.load_chain(fetch))
        assert prefix.admit(req) is None
        assert req.cache.hits == {"store": 3} and req.num_computed == 48
        engine.kv.free("late")
    finally:
        await engine.stop()
