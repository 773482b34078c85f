"""Speculative decoding with structured output, penalties and logit bias on a tiny random
Llama: greedy (and seeded) output equal to no speculation, batched with plain requests; a
grammar masks each verify row along the draft and cuts the draft where it disallows a token."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from openai import OpenAI

from daemon.api.codecs.constraints import Constraints
from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.constraint import GrammarConstraint
from daemon.loop.engine import Engine
from daemon.loop.request import RequestOutput, SamplingParams
from daemon.models.tokenizer import TextTokenizer
from daemon.service.live_server import LiveServer
from tests.checkpoints import make_dense_checkpoint
from tests.spec_doubles import OracleDrafter, speculate

VOCAB = 129280
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
}
REGEX = r"((cat|dog|mat) ){2,40}"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
BIAS = {1000: 30.0, 2000: 30.0, 3000: 30.0}  # the output runs over these: drafts find repeats

Params = Callable[[], SamplingParams]  # fresh per run: a grammar request owns its matcher


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("llama"), "llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def grammars(checkpoint) -> dict[str, xgr.CompiledGrammar]:
    constraints = Constraints(TextTokenizer(checkpoint, {}), VOCAB, (1,))

    async def compile_all() -> dict[str, xgr.CompiledGrammar]:
        return {
            "json": await constraints.compile("json", json.dumps(SCHEMA)),
            "regex": await constraints.compile("regex", REGEX),
        }

    try:
        return asyncio.run(compile_all())
    finally:
        constraints.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 19, 33, 8)]


async def started(checkpoint: Path, **overrides) -> Engine:
    settings = dict(
        model=str(checkpoint),
        kv_cache_memory_gb=0.01,
        max_num_batched_tokens=64,
        block_size=4,
        overlap=True,
    )
    engine, _ = build_engine(EngineConfig(**(settings | overrides)))
    await engine.start()
    return engine


async def run_all(
    engine: Engine, prompts: list[list[int]], params: list[Params]
) -> list[list[int]]:
    async def one(prompt: list[int], p: Params) -> list[RequestOutput]:
        return [out async for out in engine.generate(prompt, p())]

    outs = await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params)))
    return [[t for o in out for t in o.new_token_ids] for out in outs]


def plain() -> SamplingParams:
    return GREEDY


def grammar(compiled: xgr.CompiledGrammar, base: SamplingParams = GREEDY) -> Params:
    # the grammar ends the output (EOS once it may end): its matcher stops masking there
    return lambda: replace(base, ignore_eos=False, constraint=GrammarConstraint(compiled))


def penalised(base: SamplingParams = GREEDY) -> Params:
    return lambda: replace(base, **PENALTIES)


def biased() -> SamplingParams:
    return replace(GREEDY, logit_bias=BIAS)


async def drafted_equals_plain(
    checkpoint: Path, prompts: list[list[int]], params: list[Params], every: int, overlap: bool
) -> tuple[Engine, OracleDrafter, list[list[int]]]:
    """Runs `params` without speculation, then with the oracle's drafts (every `every`-th
    wrong), in one engine; asserts the outputs equal and every KV block given back."""
    engine = await started(checkpoint, overlap=overlap)
    try:
        reference = await run_all(engine, prompts, params)
        drafter = OracleDrafter(dict(zip(map(tuple, prompts), reference)), VOCAB, every=every)
        speculate(engine, drafter)
        drafted = await run_all(engine, prompts, params)
        stats = engine.stats()
    finally:
        await engine.stop()
    assert drafted == reference
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if every != 1:
        assert any(a > 0 for _, a in drafter.observed)  # drafts were taken
    return engine, drafter, reference


@pytest.mark.parametrize("kind", ["json", "regex"])
@pytest.mark.parametrize(("every", "overlap"), [(3, True), (1, False)])
async def test_grammar_greedy_equals_no_speculation(
    checkpoint, grammars, prompts, kind, every, overlap
):
    """Wrong drafts (every third; every one) are mostly disallowed by the grammar: cut before
    the forward, down to none for some steps. The grammar still ends its outputs."""
    g = grammar(grammars[kind])
    engine, drafter, reference = await drafted_equals_plain(
        checkpoint, prompts, [g, plain, g, g], every, overlap
    )
    assert engine.runner.drafts_cut > 0
    outcomes = engine.scheduler.speculator.policy.outcomes
    assert any(v < d for (d, _), (v, _) in zip(drafter.observed, outcomes))  # verified fewer
    for i in (0, 2, 3):  # the output lies in the grammar: a fresh matcher takes every token
        matcher = xgr.GrammarMatcher(grammars[kind])
        assert all(matcher.accept_token(t) for t in reference[i])


async def test_penalties_greedy_equals_no_speculation(checkpoint, prompts):
    """Row j of a verify counts the drafts before it: repetition, frequency and presence."""
    p = penalised()
    _, drafter, _ = await drafted_equals_plain(checkpoint, prompts, [p, plain, p, p], 3, True)
    assert tuple(prompts[0]) in drafter.asked  # the penalised requests speculate
    assert any(a < v for v, a in drafter.observed)  # some rejected


async def test_logit_bias_greedy_equals_no_speculation(checkpoint, prompts):
    await drafted_equals_plain(checkpoint, prompts, [biased, plain, biased, penalised()], 4, False)


async def test_seeded_sampling_with_penalties_and_grammar(checkpoint, grammars, prompts):
    """A seeded sampled request verifying point-mass drafts draws each row as sample() does
    without drafts: with penalties and a grammar on its rows, the same tokens."""
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    params = [penalised(seeded), grammar(grammars["regex"], seeded), plain]
    await drafted_equals_plain(checkpoint, prompts[:3], params, 3, True)


async def test_ngram_drafter_with_grammar_and_penalties(checkpoint, grammars, prompts):
    """The real n-gram drafter (built by name, the fixed policy) on repeating outputs."""
    g, p = grammar(grammars["regex"]), penalised(replace(GREEDY, logit_bias=BIAS))
    params = [g, biased, p, g]
    plain_engine = await started(checkpoint, overlap=False)
    try:
        reference = await run_all(plain_engine, prompts, params)
    finally:
        await plain_engine.stop()
    engine = await started(
        checkpoint, overlap=False, max_num_seqs=4, speculative="ngram", spec_policy="fixed"
    )
    try:
        drafted = await run_all(engine, prompts, params)
        stats = engine.stats()
    finally:
        await engine.stop()
    assert drafted == reference
    assert stats["spec_accepted_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def test_layer_skip_drafts_under_the_grammar(checkpoint, grammars, prompts):
    """The device drafter's passes are masked by the grammar along the draft: no draft of a
    constrained request is cut at its verify, and the output equals no speculation."""
    params = [grammar(grammars["regex"]), plain, grammar(grammars["json"]), plain]
    plain_engine = await started(checkpoint, overlap=False)
    try:
        reference = await run_all(plain_engine, prompts, params)
    finally:
        await plain_engine.stop()
    engine = await started(
        checkpoint, overlap=False, speculative="layer-skip", draft_layers=1, spec_policy="fixed"
    )
    constrained: list[int] = []
    prepare = engine.runner.prepare

    def prepared(step, kv, ops):
        for s in step.seqs:
            if s.draft and s.request.params.constraint is not None:
                constrained.append(len(s.draft))
        return prepare(step, kv, ops)

    engine.runner.prepare = prepared
    try:
        drafted = await run_all(engine, prompts, params)
        stats = engine.stats()
    finally:
        await engine.stop()
    assert drafted == reference
    assert constrained and stats["spec_draft_tokens"] > 0
    assert engine.runner.drafts_cut == 0  # every draft the passes made lies in the grammar
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# bounded, so that noise (random weights) closes each value in a few tokens
API_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tag", "ok", "n"],
    "additionalProperties": False,
}
# the prompt holds the answer's keys: a prompt lookup drafts them (and values, often wrong)
EXAMPLE = '{"name": "bob", "tag": "red", "ok": true, "n": 7}'


@pytest.fixture(scope="module")
def chat_servers(tmp_path_factory) -> Iterator[tuple[LiveServer, LiveServer]]:
    """A dense Llama with a chat template, served with `--speculative ngram` and without."""
    path = make_dense_checkpoint(
        tmp_path_factory.mktemp("llama-chat"), with_tokenizer=True, max_position_embeddings=2048
    )
    cfg_path = path / "tokenizer_config.json"
    cfg_path.write_text(
        json.dumps(json.loads(cfg_path.read_text()) | {"chat_template": CHAT_TEMPLATE})
    )
    base = EngineConfig(
        model=str(path),
        served_model_name="chat",
        kv_cache_memory_gb=0.02,
        max_num_seqs=8,
        max_model_len=1024,
        overlap=True,
        block_size=4,
    )
    servers = [
        LiveServer(cfg, ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1))
        for cfg in (base, replace(base, speculative="ngram", spec_policy="fixed"))
    ]
    try:
        for s in servers:
            s.start()
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()


def test_json_schema_through_the_api_equals_no_speculation(chat_servers) -> None:
    _, spec = chat_servers
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": API_SCHEMA}}
    answers = []
    for server in chat_servers:
        client = OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        answers.append(
            [
                client.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": f"Like {EXAMPLE} {EXAMPLE} for {who}"}],
                    response_format=fmt,
                    max_tokens=80,
                    **args,
                )
                for who in ("ann", "joe")
                for args in (dict(temperature=0.0), dict(temperature=0.9, seed=5, n=2))
            ]
        )
    texts = [[c.message.content for a in server for c in a.choices] for server in answers]
    assert texts[1] == texts[0]
    for text in texts[1]:
        jsonschema.validate(json.loads(text), API_SCHEMA)
    with urllib.request.urlopen(spec.url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["spec_draft_tokens"] > 0 and health["spec_accepted_tokens"] > 0
    assert health["kv_blocks_free"] == health["kv_blocks_total"]
