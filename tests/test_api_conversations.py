"""Chat Completions, Responses and Messages on a tiny DeepSeek-V4 through deepseek-recipe,
driven by the official openai and anthropic SDKs, whole and streamed."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import anthropic
import pytest
from openai import OpenAI

from tests.conftest import V4_SERVED_NAME

M = V4_SERVED_NAME
USER = [{"role": "user", "content": "Say hello"}]
NO_THINK = {"thinking": {"type": "disabled"}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oai(v4_api_server) -> OpenAI:
    return OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(v4_api_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=v4_api_server.url, api_key="x", max_retries=0, timeout=60)


async def wait_idle(server, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(server.url + "/health") as resp:
                stats = await resp.json()
            idle = stats["running"] == 0 and stats["waiting"] == 0
            if (idle and stats["kv_blocks_free"] == stats["kv_blocks_total"]) or (
                time.monotonic() > deadline
            ):
                return stats
            await asyncio.sleep(0.05)


# ---- Chat Completions ---------------------------------------------------------------------


def test_chat_whole_thinking(oai: OpenAI) -> None:
    r = oai.chat.completions.create(model=M, messages=USER, max_tokens=6)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == M
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert getattr(choice.message, "reasoning_content", None) is not None  # thinking is on


def test_chat_usage_counts_prefix_cache_hits(oai: OpenAI) -> None:
    msgs = [{"role": "user", "content": "a long shared prefix " * 20}]
    oai.chat.completions.create(model=M, messages=msgs, max_tokens=1)
    r = oai.chat.completions.create(model=M, messages=msgs, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_matches_usage(oai: OpenAI) -> None:
    chunks = list(
        oai.chat.completions.create(
            model=M,
            messages=USER,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_THINK,
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == 5


def test_chat_logprobs_and_seed(oai: OpenAI) -> None:
    args = dict(
        model=M,
        messages=USER,
        max_tokens=4,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_THINK,
    )
    a = oai.chat.completions.create(**args)
    b = oai.chat.completions.create(**args)
    assert a.choices[0].message.content == b.choices[0].message.content
    entries = a.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)


def test_chat_with_tools(oai: OpenAI) -> None:
    r = oai.chat.completions.create(
        model=M, messages=USER, max_tokens=8, tools=TOOLS, extra_body=NO_THINK
    )
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    chunks = list(
        oai.chat.completions.create(
            model=M, messages=USER, max_tokens=8, tools=TOOLS, stream=True, extra_body=NO_THINK
        )
    )
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_chat_json_schema_request_parses(oai: OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = oai.chat.completions.create(
        model=M, messages=USER, max_tokens=8, response_format=fmt, extra_body=NO_THINK
    )
    assert r.choices[0].message.role == "assistant"


# ---- Responses ----------------------------------------------------------------------------


def test_responses_whole_and_stream(oai: OpenAI) -> None:
    r = oai.responses.create(model=M, input="Say hello", max_output_tokens=6)
    assert r.object == "response" and r.model == M and r.status == "incomplete"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    events = list(oai.responses.create(model=M, input="hi", max_output_tokens=4, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in (
        "response.incomplete",
        "response.completed",
    )
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(numbers)


def test_responses_with_tools(oai: OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": TOOLS[0]["function"]["parameters"],
        }
    ]
    r = oai.responses.create(model=M, input="weather?", max_output_tokens=6, tools=tools)
    assert r.output


# ---- Messages -----------------------------------------------------------------------------


def test_messages_whole(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(model=M, max_tokens=6, messages=USER)
    assert r.type == "message" and r.role == "assistant" and r.model == M
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 6
    assert r.content and r.content[0].type in ("thinking", "text")


def test_messages_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=M, max_tokens=5, messages=USER, thinking={"type": "disabled"}
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and "message_stop" in events
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5


def test_messages_with_tools(claude: anthropic.Anthropic) -> None:
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
    r = claude.messages.create(
        model=M, max_tokens=6, messages=USER, tools=[tool], thinking={"type": "disabled"}
    )
    assert r.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_messages_errors_in_anthropic_shape(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=4, messages=USER)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=M, max_tokens=4, messages=[])


# ---- abandoned streams ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 1000, "stream": True}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 1000, "stream": True, "n": 3}),
        ("/v1/responses", {"input": "go", "max_output_tokens": 1000, "stream": True}),
        ("/v1/messages", {"messages": USER, "max_tokens": 1000, "stream": True}),
    ],
)
async def test_abandoned_stream_frees_blocks(v4_api_server, path: str, body: dict) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await session.post(v4_api_server.url + path, json={"model": M} | body)
        assert resp.status == 200
        events = 0
        async for line in resp.content:
            events += line.startswith(b"data: ")
            if events == 4:
                break
        resp.close()
    stats = await wait_idle(v4_api_server)
    assert stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_chat_logit_bias(v4_api_server) -> None:
    """DeepSeek-V4 chat honours `logit_bias` (the recipe drops it; we carry it to the sampler)."""
    import urllib.request

    import orjson

    req = urllib.request.Request(
        v4_api_server.url + "/tokenize",
        data=orjson.dumps({"model": M, "prompt": " hello", "add_special_tokens": False}),
        headers={"content-type": "application/json"},
    )
    forced = orjson.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"][0]
    client = OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model=M,
        messages=USER,
        max_tokens=3,
        temperature=1.0,
        seed=1,
        logit_bias={str(forced): 100},
        extra_body=NO_THINK,
    )
    assert r.choices[0].message.content == " hello" * 3


def test_chat_bad_logit_bias_is_400(v4_api_server) -> None:
    import openai

    client = OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0)
    for bias in ({"7" * 5000: 1}, {"5": 101}, [1]):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=M, messages=USER, max_tokens=1, logit_bias=bias, extra_body=NO_THINK
            )
        assert e.value.body["param"] == "logit_bias"
