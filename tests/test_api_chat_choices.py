"""n>1 Chat Completions on a tiny DeepSeek-V4 through the recipe (openai SDK): n choices with
their own seeds, one usage over them, streamed by index; a disconnect aborts all of them."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from openai import OpenAI

from daemon.api.codecs.recipe.chat_choices import ChunkMerger
from tests.conftest import V4_SERVED_NAME

M = V4_SERVED_NAME
USER = [{"role": "user", "content": "Say hello"}]
NO_THINK = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def oai(v4_api_server) -> OpenAI:
    return OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0, timeout=60)


def _args(**kw) -> dict:
    return dict(model=M, messages=USER, max_tokens=8, extra_body=NO_THINK) | kw


def test_seeded_choices_differ_and_repeat(oai: OpenAI) -> None:
    one = oai.chat.completions.create(**_args(seed=5, temperature=1.0))
    r = oai.chat.completions.create(**_args(n=3, seed=5, temperature=1.0))
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3 and texts[0] == one.choices[0].message.content
    again = oai.chat.completions.create(**_args(n=3, seed=5, temperature=1.0))
    assert [c.message.content for c in again.choices] == texts
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_choices_are_equal(oai: OpenAI) -> None:
    r = oai.chat.completions.create(**_args(n=3, temperature=0))
    assert len(r.choices) == 3 and len({c.message.content for c in r.choices}) == 1


def test_stream_by_index_matches_whole(oai: OpenAI) -> None:
    whole = oai.chat.completions.create(**_args(n=3, seed=9, temperature=1.0))
    usage = {"include_usage": True}
    chunks = list(
        oai.chat.completions.create(
            **_args(n=3, seed=9, temperature=1.0, stream=True, stream_options=usage)
        )
    )
    texts = {i: "" for i in range(3)}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    usages = [c.usage for c in chunks if c.usage]
    assert len(usages) == 1 and usages[0].completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("n", [0, 17, "2"])
async def test_bad_n_is_400(v4_api_server, n: object) -> None:
    body = {"model": M, "messages": USER, "max_tokens": 2, "n": n}
    async with (
        aiohttp.ClientSession() as session,
        session.post(v4_api_server.base_url + "/chat/completions", json=body) as r,
    ):
        assert r.status == 400 and (await r.json())["error"]["param"] == "n"


@pytest.mark.parametrize("include_usage", [False, True])
def test_one_choice_token_chunks_are_sent_unparsed(include_usage: bool) -> None:
    """n=1: a chunk without usage goes out as the recipe wrote it; the usage is still moved to
    a last chunk of no choices (include_usage) or dropped."""
    head = '{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
    null = ',"usage":null' if include_usage else ""
    token = head + '{"content":"say \\"usage\\""},"finish_reason":null}]' + null + "}"
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    last = head + '{},"finish_reason":"stop"}],"usage":' + orjson.dumps(usage).decode() + "}"
    merger = ChunkMerger(1, include_usage)
    assert merger.chunk(0, token) == token
    out = merger.chunk(0, last)
    assert isinstance(out, dict) and out["choices"][0]["finish_reason"] == "stop"
    assert out.get("usage", "absent") == (None if include_usage else "absent")
    if include_usage:
        assert merger.usage_chunk() == orjson.loads(last) | {"choices": [], "usage": usage}
    else:
        assert merger.usage_chunk() is None
    assert (
        ChunkMerger(1, True).chunk(0, token.replace(null, ""))
        == token.replace(null, "")[:-1] + ',"usage":null}'
    )
