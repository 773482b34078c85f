"""OpenAI's `logit_bias` on /v1/completions: +100 forces a token, -100 bans one, bad maps are 400."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

GREEDY = {"temperature": 0.0}
FORCED = 4242


@pytest.fixture(scope="module")
def client(api_server) -> OpenAI:
    return OpenAI(base_url=api_server.base_url, api_key="x", max_retries=0, timeout=60)


def complete(client: OpenAI, api_server, **kwargs):
    return client.completions.create(
        model=api_server.model,
        prompt="The weather today is",
        max_tokens=4,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **(GREEDY | kwargs),
    )


def test_plus_100_forces_a_token(client: OpenAI, api_server) -> None:
    r = complete(client, api_server, logit_bias={str(FORCED): 100})
    assert r.choices[0].model_extra["token_ids"] == [FORCED] * 4
    sampled = complete(client, api_server, logit_bias={str(FORCED): 100}, temperature=1.0, seed=3)
    assert sampled.choices[0].model_extra["token_ids"] == [FORCED] * 4


def test_minus_100_bans_a_token(client: OpenAI, api_server) -> None:
    plain = complete(client, api_server).choices[0].model_extra["token_ids"]
    banned = complete(client, api_server, logit_bias={str(plain[0]): -100})
    ids = banned.choices[0].model_extra["token_ids"]
    assert plain[0] not in ids
    # logprobs stay the model's own (as vLLM's default raw logprobs)
    with_lp = complete(client, api_server, logit_bias={str(plain[0]): -100}, logprobs=1)
    assert with_lp.choices[0].model_extra["token_ids"] == ids


@pytest.mark.parametrize(
    "bias",
    [
        {"abc": 1},
        {"-5": 1},
        {"5": 101},
        {"5": -100.5},
        {"5": "1"},
        {"5": True},
        {"999999999": 1},
        {"7" * 5000: 1},  # int() refuses a number this long
        {str(i): 1 for i in range(1025)},
        [1, 2],
        "5",
    ],
)
def test_bad_logit_bias_is_400(client: OpenAI, api_server, bias) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, api_server, logit_bias=bias)
    assert e.value.param == "logit_bias"
