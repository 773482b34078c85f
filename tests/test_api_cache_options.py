"""Prefix-cache options over HTTP: cached tokens by tier in usage, tenants separated by
`cache_salt`, the traffic class from the body or the X-Traffic-Class header."""

from __future__ import annotations

import aiohttp
import anthropic
from openai import OpenAI

from tests.conftest import TINY_SERVED_NAME, V4_SERVED_NAME

PROMPT = list(range(300, 380))  # 80 tokens: 4 reusable blocks of 16 (one token is computed)


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def _complete(server, **extra):
    return _client(server).completions.create(
        model=TINY_SERVED_NAME, prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra
    )


def test_cached_tokens_by_tier_and_cache_salt(api_server) -> None:
    _complete(api_server, cache_salt="tenant-a")
    again = _complete(api_server, cache_salt="tenant-a").usage.prompt_tokens_details
    other = _complete(api_server, cache_salt="tenant-b").usage.prompt_tokens_details
    assert again.cached_tokens == 64 and again.model_extra["cached_tokens_by_tier"] == {
        "device": 64
    }
    assert other.cached_tokens == 0 and "cached_tokens_by_tier" not in other.model_extra


async def test_traffic_class_header(api_server) -> None:
    body = {"model": TINY_SERVED_NAME, "prompt": "hi", "max_tokens": 1}
    async with aiohttp.ClientSession() as http:
        url = api_server.base_url + "/completions"
        async with http.post(url, json=body, headers={"X-Traffic-Class": "agent"}) as r:
            assert r.status == 200
        async with http.post(url, json=body, headers={"X-Traffic-Class": "bulk"}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "traffic_class"
            assert "chat" in err["message"] and "agent" in err["message"]


def test_v4_conversations_take_cache_options(v4_api_server) -> None:
    client = anthropic.Anthropic(base_url=v4_api_server.url, api_key="x", max_retries=0)
    msg = client.messages.create(
        model=V4_SERVED_NAME,
        max_tokens=4,
        messages=[{"role": "user", "content": "hello there"}],
        extra_headers={"X-Traffic-Class": "agent"},
        extra_body={"cache_salt": "tenant-a"},
    )
    assert msg.usage.output_tokens >= 1
    try:
        client.messages.create(
            model=V4_SERVED_NAME,
            max_tokens=4,
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"X-Traffic-Class": "bulk"},
        )
        raise AssertionError("an unknown traffic class was accepted")
    except anthropic.BadRequestError as e:
        assert "traffic_class" in str(e)
