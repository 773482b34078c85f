"""The engine end to end on a tiny random checkpoint: batching, chunked prefill,
preemption, overlap, seeds, stop strings, logprobs and aborts."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import structlog
import structlog.testing
import torch
from transformers import GenerationConfig

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.engine import Engine
from daemon.loop.request import FinishReason, RequestOutput, SamplingParams
from tests.checkpoints import load_reference, make_dense_checkpoint

PROMPT_LENGTHS = [3, 17, 40, 64, 90, 5, 33]
MAX_TOKENS = 20
BYTES_PER_BLOCK = 2 * 2 * 16 * 4 * 2 * 16  # k+v, kv heads, head_dim, fp32, layers, block size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("llama"), "llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 129280, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference_outputs(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = load_reference(checkpoint)
    config = GenerationConfig(
        max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), generation_config=config)
            outs.append(out[0, len(p) :].tolist())
    return outs


async def started(checkpoint: Path, **overrides) -> Engine:
    settings = dict(
        model=str(checkpoint), kv_cache_memory_gb=0.01, max_num_batched_tokens=64, overlap=True
    )
    engine, _ = build_engine(EngineConfig(**(settings | overrides)))
    await engine.start()
    return engine


async def collect(engine: Engine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params)]


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("overlap", [True, False])
async def test_batch_equals_alone_equals_transformers(
    checkpoint, prompts, reference_outputs, overlap
):
    engine = await started(checkpoint, overlap=overlap)
    try:
        batched = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
        alone = [await collect(engine, p, GREEDY) for p in prompts]
    finally:
        await engine.stop()
    assert [tokens(o) for o in batched] == reference_outputs
    assert [tokens(o) for o in alone] == reference_outputs
    assert all(o[-1].finish_reason == FinishReason.LENGTH for o in batched)


async def test_greedy_steps_skip_the_fp32_logits_and_keep_their_tokens(checkpoint, prompts):
    """Steps whose rows are all greedy, with nothing else on the logits, take the argmax of the
    head's own bf16 logits; asked for logprobs (fp32 logits), the same tokens."""
    engine = await started(checkpoint, dtype="bfloat16")
    model, upcasts = engine.runner.model, []
    compute = model.compute_logits

    def spy(hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = compute(hidden, upcast)
        upcasts.append(upcast)
        assert logits.dtype == (torch.float32 if upcast else torch.bfloat16)
        return logits

    model.compute_logits = spy
    logged = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    try:
        plain = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts[:3]))
        assert upcasts and not any(upcasts)
        upcasts.clear()
        with_logprobs = await asyncio.gather(*(collect(engine, p, logged) for p in prompts[:3]))
        assert upcasts and all(upcasts)
    finally:
        await engine.stop()
    assert [tokens(o) for o in plain] == [tokens(o) for o in with_logprobs]


async def test_each_step_is_logged_with_its_shape_at_debug_level(checkpoint, prompts):
    """`--log-level debug`: a `step` line per engine step, its sequences, tokens, chunk
    tokens and milliseconds (scheduling, preparation, execution; with a speculator, also what
    its cost predicted); at info, none."""
    engine, config = await started(checkpoint), structlog.get_config()
    try:
        with structlog.testing.capture_logs() as logs:
            structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
            await collect(engine, prompts[0], GREEDY)
            assert not [e for e in logs if e["event"] == "step"]
            structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
            await collect(engine, prompts[0], GREEDY)
    finally:
        structlog.configure(**config)
        await engine.stop()
    steps = [e for e in logs if e["event"] == "step"]
    assert len(steps) >= MAX_TOKENS  # the prompt's chunk(s), then a decode a token
    assert steps[0]["chunk_tokens"] == len(prompts[0]) and steps[0]["seqs"] == 1
    assert all(e["execute_ms"] > 0 and e["drafts"] == 0 for e in steps)
    assert all(e["schedule_ms"] >= 0 and "predicted_ms" not in e for e in steps)  # no speculator
    assert steps[-1]["tokens"] == 1 and steps[-1]["chunk_tokens"] == 0


async def test_waiting_for_each_launch_keeps_outputs(checkpoint, prompts, reference_outputs):
    """The accelerator ordering (the loop handles step N once N+1 is queued), forced on the
    CPU, where "queued" means done: same tokens, nothing stalls."""
    engine = await started(checkpoint)
    engine.runner.signals_launch = True
    try:
        batched = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
        assert engine.stats()["kv_blocks_free"] == engine.kv.num_blocks[0]
    finally:
        await engine.stop()
    assert [tokens(o) for o in batched] == reference_outputs


async def test_preemption_recomputes_to_the_same_output(checkpoint, prompts, reference_outputs):
    # 12 blocks of 16 tokens: every request fits alone, the batch does not.
    engine = await started(checkpoint, kv_cache_memory_gb=12 * BYTES_PER_BLOCK / 2**30)
    try:
        assert engine.kv.num_blocks == [12]
        batched = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
        assert engine.scheduler.num_preemptions > 0
        assert engine.stats()["kv_blocks_free"] == 12
    finally:
        await engine.stop()
    assert [tokens(o) for o in batched] == reference_outputs


async def test_same_seed_same_output(checkpoint, prompts):
    engine = await started(checkpoint)
    seeded = SamplingParams(
        max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=123, ignore_eos=True
    )
    other_seed = SamplingParams(**{**vars(seeded), "seed": 124})
    unseeded = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    try:
        alone = tokens(await collect(engine, prompts[2], seeded))
        crowd = await asyncio.gather(
            *(collect(engine, p, unseeded) for p in prompts),
            collect(engine, prompts[2], seeded),
            collect(engine, prompts[2], other_seed),
        )
    finally:
        await engine.stop()
    assert tokens(crowd[-2]) == alone
    assert tokens(crowd[-1]) != alone


async def test_stop_string_split_across_tokens(checkpoint, prompts):
    engine = await started(checkpoint)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    try:
        free_run = await collect(engine, prompts[1], params)
        ids = tokens(free_run)
        pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
        # a stop string made of the end of token i and the start of token i+1
        for i in range(1, len(ids) - 1):
            before, mid, after = pieces[i - 1], pieces[i], pieces[i + 1]
            if (
                len(mid) - len(before) >= 2
                and len(after) - len(mid) >= 2
                and mid.startswith(before)
            ):
                stop = mid[-1] + after[len(mid)]
                if stop not in after[: len(mid) - 1]:
                    break
        else:
            pytest.fail("no token boundary with two multi-character tokens in the output")
        stopped = await collect(
            engine, prompts[1], SamplingParams(**{**vars(params), "stop": [stop]})
        )
        streamed = [o.new_text for o in stopped]
    finally:
        await engine.stop()
    expected = after[: after.index(stop)]
    assert "".join(streamed) == expected
    assert stopped[-1].finish_reason == FinishReason.STOP
    assert stopped[-1].stop_reason == stop
    assert not any(stop in s for s in streamed)


async def test_logprobs_match_transformers(checkpoint, prompts):
    engine = await started(checkpoint)
    try:
        outs = await collect(
            engine, prompts[3], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        )
    finally:
        await engine.stop()
    lp = outs[-1].logprobs[0]
    with torch.inference_mode():
        ref = load_reference(checkpoint)(torch.tensor([prompts[3]])).logits[0, -1].log_softmax(-1)
    top = ref.topk(5)
    assert lp.token_id == top.indices[0].item()
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4)
    assert abs(lp.logprob - top.values[0].item()) < 1e-4


async def test_stop_token_and_eos(checkpoint, prompts, reference_outputs):
    engine = await started(checkpoint)
    target = reference_outputs[0][5]
    try:
        outs = await collect(
            engine,
            prompts[0],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[target]),
        )
    finally:
        await engine.stop()
    got = tokens(outs)
    assert got == reference_outputs[0][: reference_outputs[0].index(target) + 1]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == target


async def test_abort_mid_stream_frees_every_block(checkpoint, prompts):
    engine = await started(checkpoint)
    total = engine.kv.num_blocks[0]
    try:
        stream = engine.generate(
            prompts[4], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        )
        others = [asyncio.create_task(collect(engine, p, GREEDY)) for p in prompts[:3]]
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        await asyncio.gather(*others)
        for _ in range(100):
            if engine.stats()["running"] == 0:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0
        assert stats["kv_blocks_free"] == total
        assert engine.requests == {}
    finally:
        await engine.stop()


async def test_priority_admits_first(checkpoint, prompts):
    engine = await started(checkpoint, max_num_seqs=1)
    order: list[str] = []

    async def run(prompt, priority, name):
        await collect_with_priority(engine, prompt, priority)
        order.append(name)

    try:
        first = asyncio.create_task(run(prompts[0], 0, "running"))
        await asyncio.sleep(0)
        low = asyncio.create_task(run(prompts[1], 5, "low"))
        high = asyncio.create_task(run(prompts[2], -5, "high"))
        await asyncio.gather(first, low, high)
    finally:
        await engine.stop()
    assert order == ["running", "high", "low"]


async def collect_with_priority(engine: Engine, prompt: list[int], priority: int) -> None:
    req = engine.add_request(prompt, GREEDY, priority=priority)
    async for _ in engine.stream(req):
        pass


async def test_a_cpu_engine_keeps_one_openmp_team_and_none_when_idle(checkpoint, prompts):
    """The loop's thread hands back any OpenMP team it made (two teams on the cores make
    every parallel op wake its threads from sleep), and the device thread its own once idle."""
    from tests.test_openmp_team import os_threads, parallel_op

    engine = await started(checkpoint, cpu_threads=2)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    try:
        await collect(engine, prompts[4], params)
        await asyncio.sleep(0.2)  # the loop goes idle
        idle = os_threads()
        parallel_op()  # this (the loop's) thread makes a team
        assert os_threads() == idle + 1
        counts = [os_threads() async for _ in engine.generate(prompts[3], params)]
        # mid-burst: the device thread's team only (the loop let its own go)
        assert counts[0] == idle + 1
        await asyncio.sleep(0.2)
        assert os_threads() == idle
    finally:
        await engine.stop()


async def test_prompt_logprobs_in_chunks_match_transformers(checkpoint, prompts):
    """Prompt logprobs of a prompt prefilled in chunks, batched with other requests."""
    engine = await started(checkpoint)  # 64-token steps: the 90-token prompt takes two
    prompt = prompts[4]
    try:
        others = [collect(engine, p, GREEDY) for p in prompts[:3]]
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
        outs, *_ = await asyncio.gather(collect(engine, prompt, params), *others)
    finally:
        await engine.stop()
    scored = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert len(scored) == len(prompt) and scored[0] is None
    with torch.inference_mode():
        ref = load_reference(checkpoint)(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for i in range(1, len(prompt)):
        entry, row = scored[i], ref[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - row[prompt[i]].item()) < 1e-4
        target = row[prompt[i]]  # its rank, up to float noise among near-equal logprobs
        assert int((row > target + 1e-4).sum()) < entry.rank <= int((row > target - 1e-4).sum()) + 1
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
