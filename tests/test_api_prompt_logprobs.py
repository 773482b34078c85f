"""Prompt logprobs on /v1/completions (`echo` with `logprobs`, vLLM's `prompt_logprobs`), in the
request shape lm-eval's `local-completions` model sends, against transformers' logits."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from operator import itemgetter
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from daemon.models.tokenizer import TextTokenizer
from tests.checkpoints import load_reference

CONTEXT = "The quick brown fox jumps over the lazy"
CONTINUATIONS = [" dog", " cat and runs away"]


@pytest.fixture(scope="module")
def client(api_server) -> OpenAI:
    return OpenAI(base_url=api_server.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> TextTokenizer:
    return TextTokenizer(tiny_model_dir, {})


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    model = load_reference(tiny_model_dir)

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), V]: row i is log P(. | ids[: i + 1])."""
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return logprobs


def send(api_server, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{api_server.base_url}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def post(api_server, body: dict) -> dict:
    status, out = send(api_server, body)
    assert status == 200, out
    return out


def lm_eval_parse(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs, as it reads our answer."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(logprobs, tops))
        res.append((sum(logprobs), greedy))
    return res


def test_lm_eval_loglikelihood_matches_transformers(api_server, tok, reference) -> None:
    context = tok.encode(CONTEXT)
    requests = [context + tok.encode(c, add_special_tokens=False) for c in CONTINUATIONS]
    # what lm-eval's local-completions sends for a batch of loglikelihood requests
    body = {
        "model": api_server.model,
        "prompt": requests,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    out = post(api_server, body)
    assert len(out["choices"]) == 2
    parsed = lm_eval_parse(out, [len(context)] * 2)
    for ids, (total, greedy), choice in zip(requests, parsed, out["choices"]):
        ref = reference(ids)
        targets = torch.tensor(ids[1:])
        ref_each = ref[:-1].gather(1, targets[:, None]).squeeze(1)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one sampled token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
        assert torch.allclose(got, ref_each, atol=1e-3), (got - ref_each).abs().max()
        assert abs(total - ref_each[len(context) - 1 :].sum().item()) < 1e-3
        assert greedy == bool(
            (ref[len(context) - 1 : -1].argmax(-1) == targets[len(context) - 1 :]).all()
        )
        assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])  # top-1 + the token
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        assert choice["text"].startswith(tok.decode(ids))
    assert out["usage"]["completion_tokens"] == 2


def test_echo_without_generation(api_server, tok, reference) -> None:
    """max_tokens 0 with echo: the prompt alone, as OpenAI and vLLM answer it."""
    out = post(
        api_server,
        {
            "model": api_server.model,
            "prompt": CONTEXT,
            "max_tokens": 0,
            "echo": True,
            "logprobs": 2,
        },
    )
    (choice,) = out["choices"]
    ids = tok.encode(CONTEXT)
    assert choice["text"] == CONTEXT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    ref = reference(ids)
    for i in range(1, len(ids)):
        top = lp["top_logprobs"][i]
        assert len(top) <= 3 and abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-3
        assert abs(max(top.values()) - ref[i - 1].max().item()) < 1e-3
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(ids)


def test_max_tokens_zero_needs_echo(client: OpenAI, api_server) -> None:
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=api_server.model, prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens"


def test_echo_without_logprobs(client: OpenAI, api_server) -> None:
    r = client.completions.create(
        model=api_server.model, prompt=CONTEXT, max_tokens=3, echo=True, temperature=0
    )
    plain = client.completions.create(
        model=api_server.model, prompt=CONTEXT, max_tokens=3, temperature=0
    )
    assert r.choices[0].text == CONTEXT + plain.choices[0].text
    assert r.choices[0].logprobs is None


def test_stream_echo(client: OpenAI, api_server, tok) -> None:
    chunks = list(
        client.completions.create(
            model=api_server.model,
            prompt=CONTEXT,
            max_tokens=3,
            echo=True,
            logprobs=0,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    whole = client.completions.create(
        model=api_server.model,
        prompt=CONTEXT,
        max_tokens=3,
        echo=True,
        logprobs=0,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[0].choices[0].text.startswith(CONTEXT)
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    lps = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert (
        tokens == whole.choices[0].logprobs.tokens and len(tokens) == len(tok.encode(CONTEXT)) + 3
    )
    assert lps == whole.choices[0].logprobs.token_logprobs and lps[0] is None
    assert offsets == whole.choices[0].logprobs.text_offset


def test_vllm_prompt_logprobs(api_server, tok, reference) -> None:
    """vLLM's `prompt_logprobs`: per prompt position, {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the top-N, the first position null."""
    ids = tok.encode(CONTEXT)
    out = post(
        api_server,
        {"model": api_server.model, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 3},
    )
    (choice,) = out["choices"]
    assert choice["logprobs"] is None  # not asked for
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = reference(ids)
    for i in range(1, len(ids)):
        entry = plp[i]
        top = ref[i - 1].topk(3)
        expected = set(top.indices.tolist()) | {ids[i]}
        assert {int(k) for k in entry} == expected
        mine = entry[str(ids[i])]
        assert abs(mine["logprob"] - ref[i - 1, ids[i]].item()) < 1e-3
        target = ref[i - 1, ids[i]]  # its rank, up to float noise among near-equal logprobs
        assert (
            (ref[i - 1] > target + 1e-3).sum()
            < mine["rank"]
            <= (ref[i - 1] > target - 1e-3).sum() + 1
        )
        assert mine["decoded_token"] == tok.token_text(ids[i])
        best = entry[str(top.indices[0].item())]
        assert best["rank"] == 1


def test_prompt_logprobs_skip_cached_prefix(api_server, tok) -> None:
    """A prompt-logprob request reads no cached prefix (as vLLM): every position is scored, and
    the answer is the same cold or warm. Its blocks still serve later requests."""
    text = " ".join(["a long shared prompt that spans several cache blocks"] * 6)
    plain = {"model": api_server.model, "prompt": text, "max_tokens": 1, "temperature": 0}
    body = plain | {"echo": True, "logprobs": 1}
    first = post(api_server, plain)  # fills the prefix cache
    assert len(tok.encode(text)) > 48
    echoed = [post(api_server, body) for _ in range(2)]
    assert echoed[0]["choices"][0]["logprobs"] == echoed[1]["choices"][0]["logprobs"]
    for out in echoed:
        details = out["usage"].get("prompt_tokens_details") or {}
        assert not details.get("cached_tokens")
    again = post(api_server, plain)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


@pytest.mark.parametrize(
    "extra",
    [{"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": "3"}, {"echo": "yes"}],
)
def test_bad_prompt_logprobs(api_server, extra) -> None:
    body = {"model": api_server.model, "prompt": "x", "max_tokens": 1} | extra
    status, out = send(api_server, body)
    assert status == 400, out
    assert out["error"]["param"] == next(iter(extra))


def test_v4_prompt_logprobs_agree_with_sampled_logprobs(v4_api_server) -> None:
    """DeepSeek-V4: a prompt token's logprob equals the logprob it had when it was sampled."""
    prompt = list(range(100, 140))
    base = {"model": v4_api_server.model, "max_tokens": 1, "temperature": 0, "logprobs": 1}
    sampled = post(v4_api_server, base | {"prompt": prompt, "return_token_ids": True})
    (choice,) = sampled["choices"]
    (token,) = choice["token_ids"]
    echoed = post(v4_api_server, base | {"prompt": prompt + [token], "echo": True})
    lps = echoed["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == len(prompt) + 2 and lps[0] is None
    assert abs(lps[len(prompt)] - choice["logprobs"]["token_logprobs"][0]) < 1e-3
