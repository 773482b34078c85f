"""Tool calls enforced by xgrammar on a random-weight DeepSeek-V4: every sampled call parses
through the recipe's stream parser into a declared tool with schema-valid arguments."""

from __future__ import annotations

import asyncio
import json
import random

import anthropic
import jsonschema
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from tests.conftest import V4_SERVED_NAME

M = V4_SERVED_NAME
USER = [{"role": "user", "content": "What's the weather in Paris, and what is 2+3?"}]
NO_THINK = {"thinking": {"type": "disabled"}}
VOCAB = 129280
# bounded values: random weights would otherwise write unbounded strings and numbers
PARAMETERS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Tokyo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "hourly": {"type": "boolean"},
        },
        "required": ["city"],
    },
    "add": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "tag": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["label"],
    },
    "ping": {"type": "object", "properties": {}, "additionalProperties": False},
}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": params}}
    for name, params in PARAMETERS.items()
]


def _check_calls(
    calls: list[tuple[str, str]], names: frozenset[str] = frozenset(PARAMETERS)
) -> None:
    for name, arguments in calls:
        assert name in names, name
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.fixture(scope="module")
def oai(v4_api_server) -> OpenAI:
    return OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture
def aoai(v4_api_server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0, timeout=120)


async def test_required_20_samples_are_valid_calls(aoai: AsyncOpenAI) -> None:
    async def one(seed: int):
        return await aoai.chat.completions.create(
            model=M,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=800,
            extra_body=NO_THINK,
        )

    answers = await asyncio.gather(*(one(seed) for seed in range(20)))
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
        assert calls
        _check_calls(calls)


async def test_named_function_is_the_only_one_called(aoai: AsyncOpenAI) -> None:
    async def one(seed: int):
        return await aoai.chat.completions.create(
            model=M,
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}},
            seed=seed,
            max_tokens=800,
            extra_body=NO_THINK,
        )

    for r in await asyncio.gather(*(one(seed) for seed in range(6))):
        calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
        assert calls
        _check_calls(calls, frozenset({"add"}))


def test_required_stream_assembles_valid_calls(oai: OpenAI) -> None:
    for seed in (3, 4):
        stream = oai.chat.completions.create(
            model=M,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            max_tokens=800,
            stream=True,
            extra_body=NO_THINK,
        )
        names: dict[int, str] = {}
        args: dict[int, str] = {}
        finish = None
        for chunk in stream:
            for c in chunk.choices:
                for t in c.delta.tool_calls or []:
                    if t.function and t.function.name:
                        names[t.index] = t.function.name
                    if t.function and t.function.arguments:
                        args[t.index] = args.get(t.index, "") + t.function.arguments
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and names
        _check_calls([(names[i], args.get(i, "{}")) for i in sorted(names)])


async def test_auto_is_text_or_valid_calls(aoai: AsyncOpenAI) -> None:
    async def one(seed: int):
        return await aoai.chat.completions.create(
            model=M, messages=USER, tools=TOOLS, seed=seed, max_tokens=40, extra_body=NO_THINK
        )

    for r in await asyncio.gather(*(one(seed) for seed in range(10))):
        msg = r.choices[0].message
        if msg.tool_calls:
            _check_calls([(t.function.name, t.function.arguments) for t in msg.tool_calls])
        else:
            assert isinstance(msg.content, str) and msg.content


def test_auto_with_thinking_answers(oai: OpenAI) -> None:
    r = oai.chat.completions.create(model=M, messages=USER, tools=TOOLS, seed=1, max_tokens=30)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_responses_required_calls_are_valid(oai: OpenAI) -> None:
    tools = [{"type": "function", "name": n, "parameters": p} for n, p in PARAMETERS.items()]
    for seed in range(3):
        r = oai.responses.create(
            model=M,
            input="weather?",
            tools=tools,
            tool_choice="required",
            reasoning={"effort": "none"},
            max_output_tokens=800,
            extra_body={"seed": seed},
        )
        calls = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
        assert calls, r.output
        _check_calls(calls)


def test_messages_named_tool_calls_are_valid(v4_api_server) -> None:
    claude = anthropic.Anthropic(base_url=v4_api_server.url, api_key="x", max_retries=0)
    tools = [{"name": n, "input_schema": p} for n, p in PARAMETERS.items()]
    for name in ("get_weather", "tag", "add"):
        r = claude.messages.create(
            model=M,
            max_tokens=800,
            messages=USER,
            tools=tools,
            tool_choice={"type": "tool", "name": name},
            thinking={"type": "disabled"},
        )
        assert r.stop_reason == "tool_use", r
        calls = [(b.name, json.dumps(b.input)) for b in r.content if b.type == "tool_use"]
        assert calls
        _check_calls(calls, frozenset({name}))


# ---- the grammar itself, driven by uniform random choices among the allowed tokens ---------


@pytest.fixture(scope="module")
def grammar_env(v4_model_dir):
    import deepseek_recipe as dr

    from daemon.api.codecs.constraints import Constraints
    from daemon.models.tokenizer import TextTokenizer

    tok = TextTokenizer(v4_model_dir, {})
    constraints = Constraints(tok, VOCAB, (1,))
    options = dr.ConversionOptions().with_model_alias(M, dr.ModelVersion.DeepseekV4Pro)
    yield tok, constraints, options, dr.Tokenizer.from_str(tok.tokenizer.to_str())
    constraints.close()


def _allowed(matcher, mask) -> list[int]:
    matcher.fill_next_token_bitmask(mask)
    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:VOCAB].nonzero().flatten().tolist()


def _random_walk(compiled, opening: list[int], rng: random.Random, mask) -> list[int]:
    """`opening`, then tokens drawn at random among those the grammar allows, until its end
    (token 1) or 2000 tokens."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    ids = list(opening)
    assert all(matcher.accept_token(t) for t in ids)
    while len(ids) < 2000:
        t = rng.choice(_allowed(matcher, mask))
        if t == 1:
            break
        assert matcher.accept_token(t)
        ids.append(t)
    return ids


def _conversation(options, tool_choice):
    import deepseek_recipe as dr

    body = {"model": M, "messages": USER, "tools": TOOLS, "tool_choice": tool_choice} | NO_THINK
    return dr.ChatCompletionRequest(body).convert(options)


def _parse(conv, tokenizer, ids: list[int]) -> dict:
    import deepseek_recipe as dr

    gen = dr.ChatCompletionRequest.chunk_generator(conv, "id", M)
    proc = dr.StreamProcessor(gen, conv.parsing_options, tokenizer)
    acc = dr.ChatCompletionResponse("id", M, 0, 1, 0)
    events = proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=1)))
    events += proc.push(dr.InferenceChunk.tokens(ids))
    events += proc.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
    events += proc.finish()
    for ev in events:
        acc.accumulate(ev)
    return json.loads(acc.to_json())["choices"][0]


def test_auto_grammar_after_the_block_opens_gives_valid_calls(grammar_env) -> None:
    """Random weights almost never open a tool-calls block; here the text opens it."""
    import xgrammar as xgr

    tok, constraints, options, rtok = grammar_env
    oc = _conversation(options, "auto").inference_options.output_constraint
    assert oc.kind == "tool_call"
    compiled = asyncio.run(constraints.compile(oc.kind, oc.schema))
    opening = rtok.encode("Let me check.\n\n<｜DSML｜tool_calls>\n")
    rng = random.Random(0)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    for _ in range(8):
        ids = _random_walk(compiled, opening, rng, mask)
        choice = _parse(_conversation(options, "auto"), rtok, ids)
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] == "Let me check."
        calls = [
            (t["function"]["name"], t["function"]["arguments"])
            for t in choice["message"]["tool_calls"]
        ]
        _check_calls(calls)


def test_markup_only_through_the_marker_token(grammar_env) -> None:
    """The parser reads markup only where ｜DSML｜ is its one token: spelling it out of other
    tokens is never allowed, and no character rule (text, JSON, regex) can emit the token."""
    import xgrammar as xgr

    tok, constraints, options, rtok = grammar_env
    marker = tok.tokenizer.token_to_id("｜DSML｜")
    oc = _conversation(options, "required").inference_options.output_constraint
    matcher = xgr.GrammarMatcher(asyncio.run(constraints.compile(oc.kind, oc.schema)))
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    assert matcher.accept_token(tok.tokenizer.token_to_id("<"))
    assert _allowed(matcher, mask) == [marker]
    for kind, source in (("json", ""), ("regex", "[^a]{1,5}")):
        free = xgr.GrammarMatcher(asyncio.run(constraints.compile(kind, source)))
        if kind == "json":
            assert free.accept_string('{"a": "')
        assert marker not in _allowed(free, mask)


def test_thinking_does_not_allow_a_required_tool_choice(oai: OpenAI) -> None:
    from openai import BadRequestError

    with pytest.raises(BadRequestError):
        oai.chat.completions.create(
            model=M, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=4
        )


def test_a_tool_schema_the_grammar_cannot_take_is_400(oai: OpenAI) -> None:
    from openai import BadRequestError

    bad = {"type": "object", "properties": {"x": {"type": "frob"}}, "required": ["x"]}
    with pytest.raises(BadRequestError):
        oai.chat.completions.create(
            model=M,
            messages=USER,
            tools=[{"type": "function", "function": {"name": "f", "parameters": bad}}],
            tool_choice="required",
            max_tokens=4,
            extra_body=NO_THINK,
        )


# ---- Anthropic tool_choice any; at most one call (parallel_tool_calls / disable_parallel) ---


@pytest.fixture
def claude(v4_api_server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=v4_api_server.url, api_key="x", max_retries=0)


ANTHROPIC_TOOLS = [{"name": n, "input_schema": p} for n, p in PARAMETERS.items()]


async def _messages(claude: anthropic.AsyncAnthropic, tool_choice: dict, k: int) -> list:
    return await asyncio.gather(
        *(
            claude.messages.create(
                model=M,
                max_tokens=800,
                messages=USER,
                tools=ANTHROPIC_TOOLS,
                tool_choice=tool_choice,
                thinking={"type": "disabled"},
            )
            for _ in range(k)
        )
    )


def _uses(r) -> list[tuple[str, str]]:
    return [(b.name, json.dumps(b.input)) for b in r.content if b.type == "tool_use"]


async def test_messages_any_forces_a_tool_call(claude: anthropic.AsyncAnthropic) -> None:
    """ "any": the model must use one of the tools (Anthropic prefills no text before it)."""
    for r in await _messages(claude, {"type": "any"}, 8):
        assert r.stop_reason == "tool_use", r
        assert r.content[0].type == "tool_use", r.content
        _check_calls(_uses(r))


@pytest.mark.parametrize(
    "tool_choice",
    [
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "tag", "disable_parallel_tool_use": True},
    ],
)
async def test_messages_disable_parallel_tool_use_makes_one_call(
    claude: anthropic.AsyncAnthropic, tool_choice: dict
) -> None:
    for r in await _messages(claude, tool_choice, 8):
        assert r.stop_reason == "tool_use", r
        calls = _uses(r)
        assert len(calls) == 1, calls
        named = tool_choice.get("name")
        _check_calls(calls, frozenset({named}) if named else frozenset(PARAMETERS))


async def test_messages_any_with_thinking_is_400(claude: anthropic.AsyncAnthropic) -> None:
    """As Anthropic: thinking cannot go with a tool_choice that forces a tool."""
    with pytest.raises(anthropic.BadRequestError):
        await claude.messages.create(
            model=M,
            max_tokens=2048,
            messages=USER,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "any"},
            thinking={"type": "enabled", "budget_tokens": 1024},
        )


async def test_chat_parallel_tool_calls_false_makes_one_call(aoai: AsyncOpenAI) -> None:
    async def one(seed: int):
        return await aoai.chat.completions.create(
            model=M,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=800,
            extra_body=NO_THINK,
        )

    for r in await asyncio.gather(*(one(seed) for seed in range(10))):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
        assert len(calls) == 1, calls
        _check_calls(calls)


async def test_responses_parallel_tool_calls_false_makes_one_call(aoai: AsyncOpenAI) -> None:
    tools = [{"type": "function", "name": n, "parameters": p} for n, p in PARAMETERS.items()]

    async def one(seed: int):
        return await aoai.responses.create(
            model=M,
            input="weather?",
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            reasoning={"effort": "none"},
            temperature=1.0,
            max_output_tokens=800,
            extra_body={"seed": seed},
        )

    for r in await asyncio.gather(*(one(seed) for seed in range(6))):
        calls = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
        assert len(calls) == 1, r.output
        _check_calls(calls)


def test_auto_grammar_with_one_call_closes_the_block_after_it(grammar_env) -> None:
    """parallel_tool_calls false under auto: once the text opens the block, one call ends it."""
    import xgrammar as xgr

    tok, constraints, options, rtok = grammar_env
    oc = _conversation(options, "auto").inference_options.output_constraint
    compiled = asyncio.run(constraints.compile(oc.kind + ":one", oc.schema))
    opening = rtok.encode("Let me check.\n\n<｜DSML｜tool_calls>\n")
    rng = random.Random(1)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    for _ in range(6):
        ids = _random_walk(compiled, opening, rng, mask)
        choice = _parse(_conversation(options, "auto"), rtok, ids)
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(choice["message"]["tool_calls"]) == 1, choice


# ---- strict tools: parameters held as written (the recipe's strict parse dropped keywords) --

STRICT_PARAMETERS = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 4},
        "n": {"type": "integer", "enum": [1, 2]},
        "when": {"type": "string", "format": "date"},
    },
    "required": ["label", "n", "when"],
    "additionalProperties": False,
}


async def test_strict_tool_parameters_are_held_as_written(aoai: AsyncOpenAI) -> None:
    tool = {
        "type": "function",
        "function": {"name": "note", "parameters": STRICT_PARAMETERS, "strict": True},
    }

    async def one(seed: int):
        return await aoai.chat.completions.create(
            model=M,
            messages=USER,
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            extra_body=NO_THINK,
        )

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for r in await asyncio.gather(*(one(seed) for seed in range(6))):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, STRICT_PARAMETERS, format_checker=checker)


@pytest.mark.parametrize(
    ("parameters", "keyword"),
    [
        (
            {
                "type": "object",
                "properties": {"a": {"type": "array", "uniqueItems": True}},
                "required": ["a"],
            },
            "uniqueItems",
        ),
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1},
            "minProperties",
        ),
    ],
)
def test_strict_tool_with_an_unenforced_keyword_is_400(
    oai: OpenAI, parameters: dict, keyword: str
) -> None:
    from openai import BadRequestError

    tool = {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}
    with pytest.raises(BadRequestError, match=keyword) as e:
        oai.chat.completions.create(
            model=M, messages=USER, tools=[tool], max_tokens=4, extra_body=NO_THINK
        )
    assert e.value.body["param"] == "tools[0].function.parameters"
    with pytest.raises(BadRequestError, match=keyword):
        oai.responses.create(
            model=M,
            input="hi",
            tools=[{"type": "function", "name": "f", "parameters": parameters, "strict": True}],
            reasoning={"effort": "none"},
            max_output_tokens=4,
        )
