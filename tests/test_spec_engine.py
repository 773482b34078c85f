"""Speculative decoding in the engine on a tiny random Llama: greedy output equal to no
speculation (batched with requests that do not speculate, overlap on and off, drafts rejected
across block boundaries), KV blocks given back after rejections, stops and max_tokens inside a
multi-token step, and the logprobs of accepted tokens."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog
import structlog.testing
import torch

from daemon.loop.engine import Engine
from daemon.loop.request import RequestStatus, SamplingParams
from daemon.loop.scheduler import ScheduledSeq
from tests.checkpoints import make_dense_checkpoint
from tests.spec_doubles import (
    OracleDrafter,
    collect,
    run_all,
    speculate,
    start_engine,
    tokens,
)

VOCAB = 129280
BLOCK = 4  # small blocks: a rejected draft's rows often lie in blocks of their own
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# a penalised request speculates too: its verify rows count the drafts before them
PENALISED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("llama"), "llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]


async def started(checkpoint: Path, **overrides) -> Engine:
    settings = dict(
        model=str(checkpoint),
        kv_cache_memory_gb=0.01,
        max_num_batched_tokens=64,
        block_size=BLOCK,
        overlap=True,
    )
    return await start_engine(**(settings | overrides))


def watch_blocks(engine: Engine) -> list[tuple[int, int, int]]:
    """After each verify step: (blocks held before its bookkeeping, after, a request of its
    length's) of a request still running."""
    seen: list[tuple[int, int, int]] = []
    scheduler, kv = engine.scheduler, engine.kv
    verified = scheduler.verified

    def check(seq: ScheduledSeq, accepted: int, state_at: int | None) -> None:
        req = seq.request
        before = len(kv.tables.get(req.request_id, [[]])[0])
        verified(seq, accepted, state_at)
        if req.status == RequestStatus.RUNNING:
            after = len(kv.tables[req.request_id][0])
            seen.append((before, after, -(-req.num_computed // BLOCK)))

    scheduler.verified = check
    return seen


@pytest.mark.parametrize("overlap", [True, False])
async def test_greedy_equals_no_speculation_beside_plain_requests(checkpoint, prompts, overlap):
    engine = await started(checkpoint, overlap=overlap)
    params = [GREEDY, GREEDY, PENALISED, GREEDY]
    try:
        plain = await run_all(engine, prompts, params)
        plain_steps, plain_cached = engine.steps, set(engine.kv.cached)
        reference = {tuple(p): tokens(o) for p, o in zip(prompts, plain)}
        drafter = OracleDrafter(reference, VOCAB, every=7)  # some drafts wholly right
        spec = speculate(engine, drafter)
        seen = watch_blocks(engine)
        drafted = await run_all(engine, prompts, params)
        stats = engine.stats()
    finally:
        await engine.stop()
    assert [tokens(o) for o in drafted] == [tokens(o) for o in plain]
    assert tuple(prompts[2]) in drafter.asked  # penalties: speculated as well
    assert any(a == v for v, a in drafter.observed)  # some drafts taken whole
    assert any(a < v for v, a in drafter.observed)  # some rejected
    assert engine.steps - plain_steps < plain_steps  # fewer steps for the same tokens
    # rejections give back the blocks grown for them: each request holds what its length needs
    assert seen and all(after == need for _, after, need in seen)
    assert any(before > after for before, after, _ in seen)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert set(engine.kv.cached) == plain_cached  # the same blocks indexed, nothing else
    assert stats["spec_accepted_tokens"] == sum(a for _, a in drafter.observed) > 0
    assert stats["spec_draft_tokens"] == sum(v for v, _ in drafter.observed)
    assert spec.policy.outcomes == drafter.observed
    assert drafter.ended == len(prompts)  # each request of the speculating run, told once
    # every step timed for the cost, its draft rows told apart from its chunks' tokens
    assert sum(d for _, _, d, _ in spec.policy.steps) == stats["spec_draft_tokens"]
    assert all(t - s - d >= 0 for t, s, d, _ in spec.policy.steps)


async def test_greedy_verify_steps_take_the_argmax_of_the_bf16_logits(checkpoint, prompts):
    """Greedy verifies, with nothing else on the logits, skip the fp32 copy of the logits (9
    rows of the whole vocabulary a sequence); asked for logprobs (fp32 logits), they take the
    same tokens. (Against no speculation bf16 may differ: its rows are computed in batches of
    other shapes.)"""
    engine = await started(checkpoint, dtype="bfloat16")
    model, upcasts = engine.runner.model, []
    compute = model.compute_logits

    def spy(hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        upcasts.append(upcast)
        return compute(hidden, upcast)

    model.compute_logits = spy
    logged = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    try:
        plain = await run_all(engine, prompts, [GREEDY] * len(prompts))
        drafter = OracleDrafter({tuple(p): tokens(o) for p, o in zip(prompts, plain)}, VOCAB, 4)
        speculate(engine, drafter)
        upcasts.clear()
        drafted = await run_all(engine, prompts, [GREEDY] * len(prompts))
        assert drafter.observed and upcasts and not any(upcasts)
        upcasts.clear()
        with_logprobs = await run_all(engine, prompts, [logged] * len(prompts))
        assert upcasts and all(upcasts)
    finally:
        await engine.stop()
    assert [tokens(o) for o in drafted] == [tokens(o) for o in with_logprobs]
    assert any(a < v for v, a in drafter.observed)  # rejections decided on bf16 rows too


async def test_stops_and_max_tokens_inside_a_multi_token_step(checkpoint, prompts):
    engine = await started(checkpoint)
    prompt = prompts[1]
    try:
        full = await collect(engine, prompt, GREEDY)
        ref = tokens(full)
        text = "".join(o.new_text for o in full)
        stop_at = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
        cases = [
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[ref[stop_at]]),
            SamplingParams(max_tokens=24, temperature=0.0, stop=[text[len(text) // 2 :][:3]]),
        ]
        plain = [await collect(engine, prompt, p) for p in cases]
        drafter = OracleDrafter({tuple(prompt): ref}, VOCAB)
        speculate(engine, drafter)
        drafted = [await collect(engine, prompt, p) for p in cases]
    finally:
        await engine.stop()
    assert drafter.observed
    for a, b in zip(plain, drafted):
        assert tokens(b) == tokens(a)
        assert "".join(o.new_text for o in b) == "".join(o.new_text for o in a)
        assert (b[-1].finish_reason, b[-1].stop_reason) == (a[-1].finish_reason, a[-1].stop_reason)
        assert b[-1].num_output_tokens == len(tokens(a))
    assert len(tokens(drafted[0])) == 8
    # some output carried several tokens at once
    assert any(len(o.new_token_ids) > 1 for outs in drafted for o in outs)


async def test_logprobs_of_accepted_tokens_equal_no_speculation(checkpoint, prompts):
    engine = await started(checkpoint)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    try:
        plain = await run_all(engine, prompts[:2], [params] * 2)
        reference = {tuple(p): tokens(o) for p, o in zip(prompts, plain)}
        drafter = OracleDrafter(reference, VOCAB)
        speculate(engine, drafter)
        drafted = await run_all(engine, prompts[:2], [params] * 2)
    finally:
        await engine.stop()
    assert any(a > 0 for _, a in drafter.observed)
    for a, b in zip(plain, drafted):
        la = [lp for o in a for lp in o.logprobs]
        lb = [lp for o in b for lp in o.logprobs]
        assert [lp.token_id for lp in lb] == [lp.token_id for lp in la] == tokens(a)
        for x, y in zip(la, lb):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-4)


async def test_sampled_requests_run_beside_drafts(checkpoint, prompts):
    """A seeded sampled request verifying point-mass drafts gets the tokens it gets alone
    (rejection.verify draws those rows as sample() does); its output ends as asked."""
    engine = await started(checkpoint)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    try:
        plain = await run_all(engine, prompts[:3], [seeded, GREEDY, seeded])
        reference = {tuple(p): tokens(o) for p, o in zip(prompts, plain)}
        drafter = OracleDrafter(reference, VOCAB)
        speculate(engine, drafter)
        drafted = await run_all(engine, prompts[:3], [seeded, GREEDY, seeded])
    finally:
        await engine.stop()
    assert [tokens(o) for o in drafted] == [tokens(o) for o in plain]
    assert [len(tokens(o)) for o in drafted] == [20, 24, 20]


# three tokens far above the rest: the output runs over them as the model's logits choose, so
# it repeats itself and lookups draft from it, some drafts right and some not
BIASED = SamplingParams(
    max_tokens=32, temperature=0.0, ignore_eos=True, logit_bias={1000: 30, 2000: 30, 3000: 30}
)


@pytest.mark.parametrize(("drafter", "policy"), [("ngram", "adaptive"), ("suffix", "fixed")])
async def test_each_drafter_keeps_greedy_output(checkpoint, prompts, drafter, policy):
    """The real drafters, built by name as build_engine wires them (the adaptive policy over a
    cost table profiled at engine start), beside a plain request."""
    plain_engine = await started(checkpoint, overlap=False)
    params = [BIASED, GREEDY, BIASED]
    try:
        plain = await run_all(plain_engine, prompts[:3], params)
    finally:
        await plain_engine.stop()
    engine = await started(
        checkpoint, overlap=False, max_num_seqs=4, speculative=drafter, spec_policy=policy
    )
    try:
        spec = engine.scheduler.speculator
        assert spec is not None and spec.drafter.name == drafter
        assert type(spec.policy).__name__ == f"{policy.capitalize()}Policy"
        first = await run_all(engine, prompts[:3], params)
        config = structlog.get_config()
        try:
            with structlog.testing.capture_logs() as logs:
                debug = structlog.make_filtering_bound_logger(logging.DEBUG)
                structlog.configure(wrapper_class=debug)
                again = await run_all(engine, prompts[:3], params)  # suffix: finds the first's
        finally:
            structlog.configure(**config)
        stats = engine.stats()
    finally:
        await engine.stop()
    # the step trace: what the adaptive policy's cost predicted, beside the measured time
    steps = [e for e in logs if e["event"] == "step"]
    assert steps and all(("predicted_ms" in e) == (policy == "adaptive") for e in steps)
    assert [tokens(o) for o in first] == [tokens(o) for o in again] == [tokens(o) for o in plain]
    assert stats["spec_drafts"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if policy == "adaptive":  # the engine's measured steps correct the profiled table
        corrections = stats["spec_cost_corrections"]
        assert corrections and all(c["weight"] > 0 for c in corrections)
    else:
        assert "spec_cost_corrections" not in stats


async def test_verify_rows_run_in_the_compiled_decode_forward(checkpoint, prompts):
    """Dense verify rows are one-token decodes: a step of decodes and drafts runs in the
    compiled CPU decode forward (sized for the drafts), to the same greedy output."""
    engine = await started(
        checkpoint, enforce_eager=False, speculative="ngram", spec_policy="fixed", max_num_seqs=4
    )
    graphs = engine.runner.graphs
    assert graphs is not None
    rows: list[int] = []
    run = graphs.run

    def spy(input_ids, positions, batch):
        hidden = run(input_ids, positions, batch)
        if hidden is not None:
            rows.append(batch.num_decodes)
        return hidden

    graphs.run = spy
    try:
        engine.scheduler.speculator = None
        plain = await run_all(engine, prompts[:2], [GREEDY] * 2)
        drafter = OracleDrafter({tuple(p): tokens(o) for p, o in zip(prompts, plain)}, VOCAB)
        speculate(engine, drafter)
        rows.clear()
        drafted = await run_all(engine, prompts[:2], [GREEDY] * 2)
    finally:
        await engine.stop()
    assert [tokens(o) for o in drafted] == [tokens(o) for o in plain]
    assert max(rows) > 2  # more rows than requests: verify rows, compiled
