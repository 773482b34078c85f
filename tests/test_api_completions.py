"""/v1/completions through the official openai SDK: whole and streamed, n, lists, logprobs."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from openai import OpenAI

from daemon.models.tokenizer import TextTokenizer

GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(api_server) -> OpenAI:
    return OpenAI(base_url=api_server.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> TextTokenizer:
    return TextTokenizer(tiny_model_dir, {})


def test_whole(client: OpenAI, api_server, tok: TextTokenizer) -> None:
    r = client.completions.create(
        model=api_server.model, prompt="Hello there", max_tokens=6, extra_body=NO_EOS, **GREEDY
    )
    assert (
        r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == api_server.model
    )
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text
    assert choice.logprobs is None
    assert r.usage.prompt_tokens == len(tok.encode("Hello there"))
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_stream_matches_whole(client: OpenAI, api_server) -> None:
    args = dict(model=api_server.model, prompt="Once upon a time", max_tokens=8, extra_body=NO_EOS)
    whole = client.completions.create(**args, **GREEDY)
    chunks = list(
        client.completions.create(
            **args, **GREEDY, stream=True, stream_options={"include_usage": True}
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert all(c.object == "text_completion" for c in chunks)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_usage(client: OpenAI, api_server) -> None:
    chunks = list(
        client.completions.create(model=api_server.model, prompt="Hi", max_tokens=3, stream=True)
    )
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_return_token_ids(client: OpenAI, api_server, tok: TextTokenizer) -> None:
    r = client.completions.create(
        model=api_server.model,
        prompt="The sky is",
        max_tokens=5,
        extra_body={"return_token_ids": True, **NO_EOS},
        **GREEDY,
    )
    extra = r.choices[0].model_extra
    assert extra["prompt_token_ids"] == tok.encode("The sky is")
    assert len(extra["token_ids"]) == 5 == r.usage.completion_tokens
    assert tok.decode(extra["token_ids"]) == r.choices[0].text


def test_stream_return_token_ids(client: OpenAI, api_server, tok: TextTokenizer) -> None:
    chunks = list(
        client.completions.create(
            model=api_server.model,
            prompt="The sky is",
            max_tokens=5,
            stream=True,
            extra_body={"return_token_ids": True, **NO_EOS},
        )
    )
    extras = [c.choices[0].model_extra for c in chunks]
    assert extras[0]["prompt_token_ids"] == tok.encode("The sky is")
    assert all("prompt_token_ids" not in e for e in extras[1:])
    assert sum(len(e["token_ids"]) for e in extras) == 5


def test_logprobs(client: OpenAI, api_server) -> None:
    r = client.completions.create(
        model=api_server.model, prompt="Hello", max_tokens=4, logprobs=3, extra_body=NO_EOS
    )
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(isinstance(x, float) and x <= 0.0 for x in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and top[token] == logprob  # top-3 plus the sampled token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_stream_logprobs(client: OpenAI, api_server) -> None:
    chunks = list(
        client.completions.create(
            model=api_server.model,
            prompt="Hello",
            max_tokens=4,
            logprobs=0,
            stream=True,
            extra_body=NO_EOS,
        )
    )
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert len(tokens) == 4 and offsets[0] == 0 and offsets == sorted(offsets)


def test_n_and_seed(client: OpenAI, api_server) -> None:
    args = dict(model=api_server.model, prompt="Tell me", max_tokens=6, n=2, seed=7)
    r = client.completions.create(**args, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12
    again = client.completions.create(**args, extra_body=NO_EOS)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible


def test_prompt_list_fans_out(client: OpenAI, api_server, tok: TextTokenizer) -> None:
    prompts = ["First prompt", "Second one here"]
    r = client.completions.create(
        model=api_server.model, prompt=prompts, max_tokens=4, n=2, extra_body=NO_EOS, **GREEDY
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 16
    single = client.completions.create(
        model=api_server.model, prompt=prompts[1], max_tokens=4, extra_body=NO_EOS, **GREEDY
    )
    assert r.choices[2].text == r.choices[3].text == single.choices[0].text


def test_stream_fan_out(client: OpenAI, api_server) -> None:
    chunks = list(
        client.completions.create(
            model=api_server.model,
            prompt=["a", "b"],
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2, 3]
    assert chunks[-1].usage.completion_tokens == 12


def test_token_id_prompts(client: OpenAI, api_server) -> None:
    r = client.completions.create(model=api_server.model, prompt=[5, 6, 7], max_tokens=2)
    assert r.usage.prompt_tokens == 3 and len(r.choices) == 1
    r = client.completions.create(model=api_server.model, prompt=[[5, 6, 7], [8, 9]], max_tokens=2)
    assert r.usage.prompt_tokens == 5 and [c.index for c in r.choices] == [0, 1]


def test_stop_string(client: OpenAI, api_server) -> None:
    args = dict(model=api_server.model, prompt="Count with me", extra_body=NO_EOS, **GREEDY)
    full = client.completions.create(**args, max_tokens=12).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    r = client.completions.create(**args, max_tokens=12, stop=[stop])
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_sdk_errors(client: OpenAI, api_server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=api_server.model, prompt="x", max_tokens=5000)
    assert "maximum context length" in e.value.message and e.value.param == "max_tokens"
