"""Prefix-cache hits reported in the usage of Chat Completions, Responses and Messages on a
tiny DeepSeek-V4 (openai and anthropic SDKs): the same long prompt twice, the second hits."""

from __future__ import annotations

import anthropic
from openai import OpenAI

from tests.conftest import V4_SERVED_NAME

M = V4_SERVED_NAME


def _text(tag: str) -> str:
    return f"{tag}: a long shared prefix that fills several kv blocks. " * 24


def test_chat_reports_cached_tokens(v4_api_server) -> None:
    oai = OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": _text("chat")}]
    first = oai.chat.completions.create(model=M, messages=msgs, max_tokens=1)
    again = oai.chat.completions.create(model=M, messages=msgs, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached <= again.usage.prompt_tokens
    chunks = list(
        oai.chat.completions.create(
            model=M,
            messages=msgs,
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_responses_reports_cached_tokens(v4_api_server) -> None:
    oai = OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0)
    text = _text("responses")
    first = oai.responses.create(model=M, input=text, max_output_tokens=1)
    again = oai.responses.create(model=M, input=text, max_output_tokens=1)
    cached = again.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens_details.cached_tokens < cached <= again.usage.input_tokens


def test_messages_reports_cache_read_tokens(v4_api_server) -> None:
    claude = anthropic.Anthropic(base_url=v4_api_server.url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": _text("messages")}]
    first = claude.messages.create(model=M, max_tokens=1, messages=msgs)
    again = claude.messages.create(model=M, max_tokens=1, messages=msgs)
    assert (first.usage.cache_read_input_tokens or 0) < again.usage.cache_read_input_tokens
    # Anthropic counts input_tokens net of the cache reads; the prompt is the same both times
    total = again.usage.input_tokens + again.usage.cache_read_input_tokens
    assert total == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    with claude.messages.stream(model=M, max_tokens=1, messages=msgs) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens
