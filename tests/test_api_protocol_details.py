"""Protocol details of DeepSeek-V4 chat, Responses and Messages as the official SDKs use them:
stop strings, token limits, thinking defaults, usage chunks, roles, tool forms, count_tokens."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import anthropic
import pytest
from openai import OpenAI

from daemon.api.codecs.recipe.codec import CHAT, MESSAGES, RESPONSES, RecipeCodec
from daemon.models.tokenizer import TextTokenizer
from tests.conftest import V4_SERVED_NAME

M = V4_SERVED_NAME
USER = [{"role": "user", "content": "Tell me a story"}]
OFF = {"thinking": {"type": "disabled"}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}


@pytest.fixture(scope="module")
def oai(v4_api_server) -> OpenAI:
    return OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(v4_api_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=v4_api_server.url, api_key="x", max_retries=0, timeout=60)


def _prompt_tokens(r: anthropic.types.Message) -> int:
    return r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)


# ---- stop strings with thinking off (C1) ------------------------------------------------------


def _stop_in(text: str) -> str:
    """A stop string the greedy output reaches after a few characters."""
    stop = text[3:5]
    assert stop.strip(), repr(text)
    return stop


def test_chat_stop_string_whole_and_stream(oai: OpenAI) -> None:
    args = dict(model=M, messages=USER, max_tokens=12, temperature=0, extra_body=OFF)
    text = oai.chat.completions.create(**args).choices[0].message.content
    stop = _stop_in(text)
    r = oai.chat.completions.create(**args, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]
    chunks = list(oai.chat.completions.create(**args, stop=[stop], stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == text[: text.index(stop)]
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_messages_stop_sequence_whole_and_stream(claude: anthropic.Anthropic) -> None:
    args = dict(
        model=M,
        max_tokens=12,
        messages=USER,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},  # (this SDK's create() no longer names it)
    )
    text = claude.messages.create(**args).content[0].text
    stop = _stop_in(text)
    r = claude.messages.create(**args, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]
    with claude.messages.stream(**args, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.content[0].text == r.content[0].text


# ---- max_completion_tokens (C5) ---------------------------------------------------------------


def test_chat_max_completion_tokens(oai: OpenAI) -> None:
    r = oai.chat.completions.create(model=M, messages=USER, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    chunks = list(
        oai.chat.completions.create(
            model=M,
            messages=USER,
            max_completion_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 3


# ---- thinking defaults per protocol (C6) ------------------------------------------------------


def test_messages_think_only_when_asked(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(model=M, max_tokens=4, messages=USER)
    assert [b.type for b in r.content] == ["text"]
    r = claude.messages.create(
        model=M, max_tokens=4, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert r.content[0].type == "thinking"


def test_messages_forced_tool_choice_without_thinking(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(
        model=M,
        max_tokens=16,
        messages=USER,
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert r.stop_reason in ("max_tokens", "tool_use")


def test_chat_and_responses_think_by_default(oai: OpenAI) -> None:
    """As DeepSeek's own API: thinking on unless the request turns it off."""
    r = oai.chat.completions.create(model=M, messages=USER, max_tokens=3)
    assert r.choices[0].message.content == "" and r.usage.completion_tokens == 3
    assert r.choices[0].message.reasoning_content
    r = oai.responses.create(model=M, input="Tell me a story", max_output_tokens=3)
    assert [item.type for item in r.output] == ["reasoning"]
    r = oai.responses.create(
        model=M, input="Tell me a story", max_output_tokens=3, reasoning={"effort": "none"}
    )
    assert [item.type for item in r.output] == ["message"]


@pytest.fixture(scope="module")
def v4_tokenizer(v4_model_dir: Path) -> TextTokenizer:
    return TextTokenizer(v4_model_dir, {})


@pytest.mark.parametrize(
    "default,chat,responses,messages",
    [("auto", True, True, False), ("on", True, True, True), ("off", False, False, False)],
)
def test_thinking_default_setting(
    v4_tokenizer: TextTokenizer, default: str, chat: bool, responses: bool, messages: bool
) -> None:
    codec = RecipeCodec(v4_tokenizer, M, 4096, thinking_default=default)
    bodies = {
        CHAT: {"model": M, "messages": USER},
        RESPONSES: {"model": M, "input": "hi"},
        MESSAGES: {"model": M, "messages": USER, "max_tokens": 4},
    }
    thinks = {
        p: codec.prepare(p, body, "id").conversation.conversation.thinking_mode
        for p, body in bodies.items()
    }
    assert thinks == {CHAT: chat, RESPONSES: responses, MESSAGES: messages}
    asked = codec.prepare(MESSAGES, bodies[MESSAGES] | {"thinking": {"type": "enabled"}}, "id")
    assert asked.conversation.conversation.thinking_mode  # the request decides over the default


# ---- stream usage chunks (C11) ----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_chat_stream_usage_only_when_asked(oai: OpenAI, n: int) -> None:
    args = dict(model=M, messages=USER, max_tokens=4, n=n, stream=True, extra_body=OFF)
    chunks = list(oai.chat.completions.create(**args))
    assert all(c.usage is None for c in chunks)
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == n
    chunks = list(oai.chat.completions.create(**args, stream_options={"include_usage": True}))
    *rest, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 4 * n
    assert all(c.usage is None and c.choices for c in rest)


# ---- developer role (C13) ---------------------------------------------------------------------


def test_chat_developer_role_is_system(oai: OpenAI) -> None:
    def prompt_tokens(role: str) -> int:
        msgs = [{"role": role, "content": "Be brief."}, *USER]
        r = oai.chat.completions.create(model=M, messages=msgs, max_tokens=1, extra_body=OFF)
        return r.usage.prompt_tokens

    assert prompt_tokens("developer") == prompt_tokens("system")


# ---- Anthropic tool forms (C8) ----------------------------------------------------------------


def test_messages_custom_type_tools(claude: anthropic.Anthropic) -> None:
    """litellm's Anthropic provider sends every client tool as `"type": "custom"`."""
    r = claude.messages.create(
        model=M, max_tokens=4, messages=USER, tools=[TOOL | {"type": "custom"}]
    )
    plain = claude.messages.create(model=M, max_tokens=4, messages=USER, tools=[TOOL])
    assert _prompt_tokens(r) == _prompt_tokens(plain)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=M,
            max_tokens=4,
            messages=USER,
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )


# ---- count_tokens (C14) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"system": "Be brief."},
        {"tools": [TOOL]},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    ],
)
def test_messages_count_tokens(claude: anthropic.Anthropic, extra: dict) -> None:
    counted = claude.messages.count_tokens(model=M, messages=USER, **extra)
    r = claude.messages.create(model=M, max_tokens=1, messages=USER, **extra)
    assert counted.input_tokens == _prompt_tokens(r) > 0


def test_messages_count_tokens_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.count_tokens(model="nope", messages=USER)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.count_tokens(model=M, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body,status",
    [
        ({"messages": USER}, 400),
        ({"model": M}, 400),
        ({"model": M, "messages": "hi"}, 400),
        ({"model": M, "messages": USER, "tools": 5}, 400),
        ({"model": M, "messages": USER, "tools": [{"type": "custom"}]}, 400),
        ({"model": M, "messages": USER, "thinking": "yes"}, 400),
        ({"model": M, "messages": USER, "system": [{"type": "text", "text": 5}]}, 400),
        ({"model": M, "messages": USER, "max_tokens": 4}, 200),
    ],
)
async def test_count_tokens_bad_bodies(v4_api_server, body: dict, status: int) -> None:
    url = v4_api_server.url + "/v1/messages/count_tokens"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        payload = await r.json()
        assert r.status == status, payload
        if status == 400:
            assert payload["type"] == "error"
            assert payload["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "extra", [{"max_completion_tokens": "x"}, {"messages": [{"role": "developer"}]}]
)
async def test_tokenize_messages_bad_bodies(v4_api_server, extra: dict) -> None:
    """/tokenize adapts a chat body as chat completions does, and its mistakes are 400s."""
    body = {"model": V4_SERVED_NAME, "messages": [{"role": "user", "content": "hi"}]} | extra
    async with (
        aiohttp.ClientSession() as s,
        s.post(v4_api_server.url + "/tokenize", json=body) as r,
    ):
        payload = await r.json()
        assert r.status == 400, payload
        assert payload["error"]["type"] == "invalid_request_error"
