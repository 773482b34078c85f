"""The engine's side of the prefill/decode KV handoff, in one process: a decode engine fed by a
prefill engine's `prefill_export` (through a KVSource over it) decodes as a unified engine
does, dense and DeepSeek-V4, the full blocks through the block store both share; a stored
block removed or corrupted before the decode side reads it is fetched again; a failed, late or
misfit fetch is computed locally and counted; aborts and cancellations on either side give
every block back."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from prometheus_client import generate_latest

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.engine import Engine, RequestRejected
from daemon.loop.handoff import Fetched, HandoffFailed, export_bytes
from daemon.loop.metrics import EngineMetrics
from daemon.loop.request import SamplingParams
from daemon.models.base import KVExport, RequestState
from tests.checkpoints import make_dense_checkpoint, make_v4_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# dense: 16-token blocks; V4 (rates 4 and 8): 8-token blocks. The imported range is [0, len - 1):
# partial last blocks, [0, end) ending on a block boundary (len = k * block + 1), the whole
# prompt on one (len = k * block), and V4 prompts crossing compression windows
LENGTHS = {"dense": [40, 17, 16, 3, 70], "v4": [37, 33, 32, 3]}
SHORT = replace(GREEDY, max_tokens=4)


@dataclass
class Engines:
    prefill: Engine
    decode: Engine
    unified: Engine
    block: int
    metrics: EngineMetrics = field(default_factory=EngineMetrics)


@pytest.fixture(scope="module", params=["dense", "v4"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family: str, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(family)
    return make_dense_checkpoint(path, "llama") if family == "dense" else make_v4_checkpoint(path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(checkpoint: Path, family: str, tmp_path_factory):
    store = str(tmp_path_factory.mktemp(f"{family}-store"))  # the prefill and decode engines'
    settings = dict(
        model=str(checkpoint),
        kv_cache_memory_gb=0.01,
        max_num_seqs=4,
        max_num_batched_tokens=32,  # prompts take several chunks
        overlap=True,
    )
    metrics = EngineMetrics()
    built = []
    for observer, own in ((None, store), (metrics, store), (None, None)):
        engine, _ = build_engine(
            EngineConfig(**settings, kv_store_dir=own),
            observer,
            handoff_timeout_s=20.0,
            handoff_min_tokens=3,
        )
        await engine.start()
        built.append(engine)
    metrics.collect_engine(built[1])
    block = built[0].kv.prefix_block
    yield Engines(*built, block=block, metrics=metrics)
    for engine in built:
        await engine.stop()


async def test_the_handoff_settings_are_the_built_engines(engines: Engines) -> None:
    # as `--handoff-timeout-s` and `--handoff-min-tokens` reach them
    assert engines.decode.handoffs.timeout_s == 20.0
    assert engines.decode.handoff_min_tokens == 3


class EngineSource:
    """A KVSource over a prefill engine in this process: its `prefill_export`."""

    def __init__(self, engine: Engine, request_id: str, cache_salt: bytes = b"") -> None:
        self.engine, self.request_id, self.cache_salt = engine, request_id, cache_salt
        self.block_keys: list[bytes] = []

    async def fetch(
        self, prompt_ids: list[int], block_keys: list[bytes], end: int, store=None
    ) -> Fetched:
        self.block_keys = block_keys
        got = await self.engine.prefill_export(
            prompt_ids, self.request_id, self.cache_salt, store=store
        )
        assert got.export.end == end
        return got


class Raising:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def fetch(
        self, prompt_ids: list[int], block_keys: list[bytes], end: int, store=None
    ) -> Fetched:
        await asyncio.sleep(0)
        raise self.error


class Gated:
    """Fetches only once `gate` is set; records whether it was cancelled meanwhile."""

    def __init__(self, source: EngineSource | None = None) -> None:
        self.source, self.gate = source, asyncio.Event()
        self.started, self.cancelled = asyncio.Event(), False

    async def fetch(
        self, prompt_ids: list[int], block_keys: list[bytes], end: int, store=None
    ) -> Fetched:
        self.started.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        assert self.source is not None
        return await self.source.fetch(prompt_ids, block_keys, end, store)


class Altered:
    """A real export (all of it: no store offered), altered by `change` before it is
    returned."""

    def __init__(self, source: EngineSource, change) -> None:
        self.source, self.change = source, change

    async def fetch(
        self, prompt_ids: list[int], block_keys: list[bytes], end: int, store=None
    ) -> Fetched:
        return Fetched(self.change((await self.source.fetch(prompt_ids, block_keys, end)).export))


class Spoiling:
    """A real handoff through the store; before the decode side reads them, `spoil` is done
    to the stored blocks' files (the first fetch only: a second one sends everything)."""

    def __init__(self, source: EngineSource, spoil) -> None:
        self.source, self.spoil, self.fetches = source, spoil, []

    async def fetch(
        self, prompt_ids: list[int], block_keys: list[bytes], end: int, store=None
    ) -> Fetched:
        got = await self.source.fetch(prompt_ids, block_keys, end, store)
        self.fetches.append(len(got.stored))
        if got.stored and len(self.fetches) == 1:
            self.spoil(self.source.engine.store, got.stored)
        return got


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def run(engine: Engine, ids: list[int], params=GREEDY, source=None, rid=None) -> list[int]:
    req = engine.add_request(ids, params, request_id=rid, kv_source=source)
    return [t async for out in engine.stream(req) for t in out.new_token_ids]


def all_free(engine: Engine) -> bool:
    return all(u.num_free == u.num_blocks for u in engine.kv.usage())


async def settled(*engines: Engine) -> None:
    """Until nothing runs, waits or moves and every block is back (a few seconds at most)."""
    for _ in range(500):
        if all(not e.requests and not e.handoffs.pending and all_free(e) for e in engines):
            return
        await asyncio.sleep(0.01)
    raise AssertionError([e.stats() for e in engines])


async def test_handoff_decodes_as_a_unified_engine(engines: Engines, family: str) -> None:
    p, d, u = engines.prefill, engines.decode, engines.unified
    prompts = [prompt(i, n) for i, n in enumerate(LENGTHS[family])]
    want = [await run(u, ids) for ids in prompts]
    before = d.handoffs.stats.imported, p.handoffs.stats.exported
    sources = [EngineSource(p, f"{family}-h{i}") for i in range(len(prompts))]
    # together: the prefill engine batches the exports, the decode engine the imports
    got = await asyncio.gather(*(run(d, ids, source=s) for ids, s in zip(prompts, sources)))
    assert got == want
    short = sum(len(ids) < 2 for ids in prompts)
    assert d.handoffs.stats.imported - before[0] == len(prompts) - short
    assert p.handoffs.stats.exported - before[1] == len(prompts) - short
    assert (
        d.handoffs.stats.bytes_imported > 0
        and d.handoffs.stats.bytes_imported == p.handoffs.stats.bytes_exported
    )
    assert sum(d.handoffs.stats.recomputed.values()) == 0
    # the keys a router would match: the prompt's full blocks, this engine's hash chain
    assert [len(s.block_keys) for s in sources] == [len(ids) // engines.block for ids in prompts]
    await settled(p, d)

    # again: the prefill engine's prefix cache has the blocks, the decode engine's too (its
    # imported blocks were registered as any computed ones)
    hits = p.stats()["prefix_hit_tokens"]
    assert await run(d, prompts[0], source=EngineSource(p, f"{family}-again")) == want[0]
    assert p.stats()["prefix_hit_tokens"] > hits
    hits, swa_hits = d.stats()["prefix_hit_tokens"], d.stats().get("swa_hits", 0)
    assert await run(d, prompts[0]) == want[0]  # no source: its own cache
    assert d.stats()["prefix_hit_tokens"] > hits
    if family == "v4":  # the imported requests' windows were snapshotted: no replay
        assert d.stats()["swa_hits"] > swa_hits
    await settled(p, d)


def _corrupt(store, keys: list[bytes]) -> None:
    """A payload byte of the last stored block flipped (its size unchanged: the prefill side
    cannot tell)."""
    path = store.path(keys[-1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _remove(store, keys: list[bytes]) -> None:
    store.path(keys[len(keys) // 2]).unlink()


def _counts(engine: Engine) -> dict[str, int]:
    s = engine.handoffs.stats
    return dict(
        imported=s.imported,
        recomputed=sum(s.recomputed.values()),
        wire=s.bytes_imported,
        from_store=s.bytes_from_store,
        blocks=s.blocks_from_store,
        stored=s.blocks_stored,
        fallbacks=s.store_fallbacks,
    )


def _grown(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in _counts(engine).items()}


async def test_full_blocks_come_through_the_store(engines: Engines, family: str) -> None:
    """The prefill engine leaves the prompt's full blocks in the store they share and sends
    the rest; the decode engine reads them by key and decodes as a unified engine does."""
    p, d, u, block = engines.prefill, engines.decode, engines.unified, engines.block
    ids = prompt(90, 5 * block + 3)
    full = (len(ids) - 1) // block
    want = await run(u, ids, SHORT)
    before, sent = _counts(d), _counts(p)
    assert await run(d, ids, SHORT, EngineSource(p, f"{family}-store")) == want
    got = _grown(d, before)
    assert (got["imported"], got["blocks"], got["fallbacks"]) == (1, full, 0)
    assert _grown(p, sent)["stored"] == full
    # what did not go over the wire is exactly the stored blocks
    direct = await p.prefill_export(ids, f"{family}-direct")
    assert direct.stored == []
    assert got["from_store"] == full * p.store.block_bytes
    assert export_bytes(direct.export) - got["wire"] == got["from_store"]
    await settled(p, d)

    # the decode side has no store (the unified engine) or another one: all over the wire
    before = _counts(u)
    assert await run(u, ids, SHORT, EngineSource(p, f"{family}-nostore")) == want
    grown = _grown(u, before)
    assert (grown["imported"], grown["blocks"], grown["wire"]) == (
        1,
        0,
        export_bytes(direct.export),
    )
    offer = p.handoffs.offer
    assert offer is not None and offer == d.handoffs.offer
    for other in (replace(offer, identity="another"), replace(offer, fingerprint="00" * 16)):
        assert (
            await p.prefill_export(ids, f"{family}-{other.identity[:3]}", store=other)
        ).stored == []
    same = await p.prefill_export(ids, f"{family}-same", store=offer)
    assert len(same.stored) == full and same.export.start == full * block
    await settled(p, d, u)


@pytest.mark.parametrize("spoil", [_corrupt, _remove])
async def test_a_stored_block_spoiled_before_the_read_is_fetched_again(
    engines: Engines, family: str, spoil
) -> None:
    p, d, u, block = engines.prefill, engines.decode, engines.unified, engines.block
    ids = prompt(100 + (spoil is _remove), 4 * block + 5)
    want = await run(u, ids, SHORT)
    before, bad = _counts(d), d.store.counters.bad_files
    source = Spoiling(EngineSource(p, f"{family}-{spoil.__name__}"), spoil)
    assert await run(d, ids, SHORT, source) == want
    # the store path, then (a block missing or failing its checksum) all of it over the wire
    assert source.fetches == [(len(ids) - 1) // block, 0]
    got = _grown(d, before)
    assert (got["imported"], got["fallbacks"], got["recomputed"], got["blocks"]) == (1, 1, 0, 0)
    assert d.store.counters.bad_files == bad + (spoil is _corrupt)  # and it was removed
    await settled(p, d)


async def test_sampling_and_several_choices_unchanged(engines: Engines, family: str) -> None:
    """Seeded sampling, penalties, logit bias and logprobs continue from an import exactly as
    in a unified engine; several choices of one prompt each fetch their own export."""
    p, d, u = engines.prefill, engines.decode, engines.unified
    ids = prompt(40, 29)
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=s, repetition_penalty=1.3)
        for s in (1, 2)
    ] + [SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=3, logit_bias={7: 5.0})]
    want = await asyncio.gather(*(run(u, ids, sp) for sp in params))
    got = await asyncio.gather(
        *(run(d, ids, sp, EngineSource(p, f"{family}-n{i}")) for i, sp in enumerate(params))
    )
    assert got == want and len({tuple(t) for t in got}) > 1
    req = d.add_request(ids, replace(GREEDY, logprobs=2), kv_source=EngineSource(p, f"{family}-lp"))
    got_lp = [lp async for out in d.stream(req) for lp in (out.logprobs or [])]
    req = u.add_request(ids, replace(GREEDY, logprobs=2))
    want_lp = [lp async for out in u.stream(req) for lp in (out.logprobs or [])]
    assert [x.token_id for x in got_lp] == [x.token_id for x in want_lp]
    # the last prompt token runs as a decode here, in a prefill chunk there: the same to rounding
    for x, y in zip(got_lp, want_lp):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    await settled(p, d)


def _wrong_dtype(e: KVExport) -> KVExport:
    group = next(iter(e.blocks))
    rows = [t.to(torch.float16) for t in e.blocks[group]]
    return replace(e, blocks=e.blocks | {group: rows})


def _block_short(e: KVExport) -> KVExport:
    return replace(e, blocks={g: [t[:-1] for t in rows] for g, rows in e.blocks.items()})


def _wrong_end(e: KVExport) -> KVExport:
    return replace(e, end=e.end - 1, state=RequestState(e.end - 1, e.state.tensors))


def _missing_group(e: KVExport) -> KVExport:
    return replace(e, blocks=dict(list(e.blocks.items())[1:]))


def _state_misfit(e: KVExport) -> KVExport:
    # dense: a state where none belongs; V4: one tensor of the ring cut short
    tensors = [t[:-1] for t in e.state.tensors] or [torch.zeros(3)]
    return replace(e, state=RequestState(e.state.position, tensors))


MISFITS = [_wrong_dtype, _block_short, _wrong_end, _missing_group, _state_misfit]


async def test_failed_fetches_are_computed_locally(engines: Engines, family: str) -> None:
    p, d, u = engines.prefill, engines.decode, engines.unified
    ids = prompt(50, 26)
    want = await run(u, ids, SHORT)
    before = dict(d.handoffs.stats.recomputed)
    imported = d.handoffs.stats.imported
    sources = [
        Raising(HandoffFailed("bad checksum")),
        Raising(TimeoutError()),
        Raising(ConnectionResetError("peer gone")),
        Raising(RuntimeError("a bug in the source")),
        *(Altered(EngineSource(p, f"{family}-m{i}"), m) for i, m in enumerate(MISFITS)),
    ]
    # one at a time: V4 reserves a per-request block too, of which there are max_num_seqs
    got = [await run(d, ids, SHORT, s) for s in sources]
    hanging = Gated()  # never let through: the deadline ends it
    d.handoffs.timeout_s = 0.3
    try:
        got.append(await run(d, ids, SHORT, hanging))
        sources.append(hanging)
    finally:
        d.handoffs.timeout_s = 20.0
    assert got == [want] * len(sources)
    assert hanging.cancelled
    counted = {r: n - before.get(r, 0) for r, n in d.handoffs.stats.recomputed.items()}
    expected = {"failed": 1, "timeout": 2, "connection": 1, "error": 1, "layout": len(MISFITS)}
    assert {r: n for r, n in counted.items() if n} == expected
    assert d.handoffs.stats.imported == imported
    # a one-token prompt has nothing to move, one under handoff_min_tokens is cheaper here;
    # prompt logprobs are computed here
    unused = Raising(HandoffFailed("unused"))
    assert await run(d, [5], SHORT, unused) == await run(u, [5], SHORT)
    assert await run(d, ids[:2], SHORT, unused) == await run(u, ids[:2], SHORT)
    lp = replace(SHORT, prompt_logprobs=1)
    assert await run(d, ids, lp, unused) == await run(u, ids, lp)
    assert d.handoffs.stats.recomputed["short_prompt"] - before.get("short_prompt", 0) == 2
    assert d.handoffs.stats.recomputed["prompt_logprobs"] - before.get("prompt_logprobs", 0) == 1
    await settled(p, d)

    text = generate_latest(engines.metrics.registry).decode()
    assert 'deepinfer:kv_handoff_total{result="recomputed"}' in text
    assert (
        f'deepinfer:kv_handoff_recomputed_total{{reason="layout"}} {float(d.handoffs.stats.recomputed["layout"])}'
        in text
    )
    assert 'deepinfer:kv_handoff_bytes_total{direction="imported"}' in text
    stats = d.stats()
    assert stats["kv_handoff_recomputed"] == sum(d.handoffs.stats.recomputed.values())


async def test_abort_during_the_fetch_gives_the_blocks_back(engines: Engines, family: str) -> None:
    p, d = engines.prefill, engines.decode
    await settled(p, d)
    free = [u.num_free for u in d.kv.usage()]
    ids = prompt(60, 45)
    gated = Gated(EngineSource(p, f"{family}-abort"))
    req = d.add_request(ids, GREEDY, kv_source=gated)
    await gated.started.wait()
    reserved = [u.num_free for u in d.kv.usage()]
    assert reserved != free  # the prompt's blocks were reserved before the fetch
    assert sum(f - r for f, r in zip(free, reserved)) >= math.ceil(len(ids) / engines.block)
    outs = d.stream(req)
    d.abort(req.request_id)
    last = [out async for out in outs][-1]
    assert last.finished and last.finish_reason == "abort"
    await asyncio.sleep(0.05)
    assert gated.cancelled
    assert [u.num_free for u in d.kv.usage()] == free
    assert d.stats()["kv_handoffs_in_flight"] == 0
    await settled(p, d)


async def test_cancelled_export_gives_the_prefill_blocks_back(
    engines: Engines, family: str
) -> None:
    p = engines.prefill
    await settled(p)
    ids = prompt(70, 150)  # several 32-token chunks
    task = asyncio.create_task(p.prefill_export(ids, f"{family}-cancel"))
    for _ in range(1000):
        if p.requests and any(r.num_computed > 0 for r in p.requests.values()):
            break
        await asyncio.sleep(0.001)
    assert not all_free(p)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not p.requests and p.stats()["kv_handoffs_in_flight"] == 0
    await settled(p)
    # and a clean one after it; an id in use or a one-token prompt is refused
    export = (await p.prefill_export(ids, f"{family}-after")).export
    assert (export.start, export.end) == (0, len(ids) - 1)
    with pytest.raises(RequestRejected):
        await p.prefill_export([3], f"{family}-one")
    await settled(p)


async def test_no_room_to_reserve_computes_locally(engines: Engines, family: str) -> None:
    """While the pool has no room for the prompt's blocks the handoff waits, until its deadline;
    then the request computes its prompt here once blocks come back."""
    p, d, u = engines.prefill, engines.decode, engines.unified
    await settled(p, d)
    ids = prompt(80, 20)
    want = await run(u, ids, SHORT)
    before = d.handoffs.stats.recomputed["no_room"]
    hog = "hog"  # another holder of every paged block
    assert d.kv.grow(hog, d.kv.capacity_tokens())
    gated = Gated(EngineSource(p, f"{family}-room"))
    gated.gate.set()
    d.handoffs.timeout_s = 0.2
    try:
        task = asyncio.create_task(run(d, ids, SHORT, gated))
        for _ in range(300):
            if d.handoffs.stats.recomputed["no_room"] > before:
                break
            await asyncio.sleep(0.01)
    finally:
        d.handoffs.timeout_s = 20.0
        d.kv.free(hog)
    assert await task == want
    assert d.handoffs.stats.recomputed["no_room"] == before + 1
    assert not gated.started.is_set()
    await settled(p, d)
