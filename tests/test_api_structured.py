"""Structured output: JSON schema and regex constraints enforced by xgrammar on random-weight
models (DeepSeek path via the recipe's OutputConstraint, dense path via response_format)."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import jsonschema
import pytest

from tests.conftest import V4_SERVED_NAME

M = V4_SERVED_NAME
SCHEMA = {
    "type": "object",
    "properties": {
        # not maxLength: xgrammar 0.2.9 lets control characters into length-bounded strings
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,6}-[0-9]{2}"
NO_THINK = {"thinking": {"type": "disabled"}}


def _chat(fmt: dict, seed: int, **extra) -> dict:
    return (
        {
            "model": M,
            "messages": [{"role": "user", "content": "Give me a person as json"}],
            "max_tokens": 120,
            "seed": seed,
            "response_format": fmt,
        }
        | NO_THINK
        | extra
    )


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_json_schema_50_samples_validate(v4_api_server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    url = v4_api_server.base_url + "/chat/completions"
    async with aiohttp.ClientSession() as s:
        # unseeded: 50 different draws from the engine's generator (per-row seeds cost more)
        answers = await asyncio.gather(*(_post(s, url, _chat(fmt, None)) for _ in range(50)))
    for a in answers:
        choice = a["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


async def test_regex_samples_fullmatch(v4_api_server) -> None:
    fmt = {"type": "regex", "regex": REGEX}
    url = v4_api_server.base_url + "/chat/completions"
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(_post(s, url, _chat(fmt, seed)) for seed in range(20)))
    for a in answers:
        assert re.fullmatch(REGEX, a["choices"][0]["message"]["content"]), a


async def test_json_schema_stream_ends_properly(v4_api_server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    url = v4_api_server.base_url + "/chat/completions"
    text, finish, done = [], None, False
    async with aiohttp.ClientSession() as s, s.post(url, json=_chat(fmt, 3, stream=True)) as r:
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    text.append(c["delta"].get("content") or "")
                    finish = c["finish_reason"] or finish
    assert done and finish == "stop"
    jsonschema.validate(json.loads("".join(text)), SCHEMA)


def test_grammar_waits_for_end_of_thinking(v4_model_dir) -> None:
    """In thinking mode the grammar takes over only after the end-of-thinking token."""
    from daemon.api.constraints import Constraints
    from daemon.loop.constraint import GrammarConstraint, allocate_bitmask
    from daemon.tokenizer import TextTokenizer

    tok = TextTokenizer(v4_model_dir, {})
    think_end = tok.tokenizer.token_to_id("</think>")
    constraints = Constraints(tok, 129280, (1,))
    compiled = asyncio.run(constraints.compile("regex", REGEX))
    c = GrammarConstraint(compiled, trigger=think_end)
    mask = allocate_bitmask(1, 129280)
    free_text = tok.encode("hmm, let me think", add_special_tokens=False)
    for t in free_text:
        assert not c.fill(mask, 0)
        c.accept(t)
    c.accept(think_end)
    assert c.fill(mask, 0)
    import torch

    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.flatten()[:129280].nonzero().flatten().tolist()
    texts = [tok.token_text(i) for i in allowed]
    assert texts and all(re.fullmatch(r"[a-z]{1,6}", t) for t in texts), texts[:20]
    constraints.close()


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
        {"type": "regex", "regex": "(unclosed"},
    ],
)
async def test_bad_constraint_is_400(v4_api_server, fmt: dict) -> None:
    async with aiohttp.ClientSession() as s:
        url = v4_api_server.base_url + "/chat/completions"
        async with s.post(url, json=_chat(fmt, 0)) as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"]
