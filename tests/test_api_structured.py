"""Structured output: JSON schema and regex constraints enforced by xgrammar on random-weight
models (DeepSeek path via the recipe's OutputConstraint, dense path via response_format)."""

from __future__ import annotations

import asyncio
import datetime
import json
import re
from collections.abc import Iterator

import aiohttp
import jsonschema
import pytest

from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from tests.checkpoints import make_dense_checkpoint
from tests.conftest import V4_SERVED_NAME, LiveServer

M = V4_SERVED_NAME
SCHEMA = {
    "type": "object",
    "properties": {
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
# One property per keyword, each bounded so that noise (random weights) closes it in a few
# tokens: the grammar alone holds the shape.
KEYWORDS: dict[str, dict] = {
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-f]{2,4}-[0-9]$"},
    "format date": {"type": "string", "format": "date"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format time": {"type": "string", "format": "time"},
    "format uuid": {"type": "string", "format": "uuid"},
    "format ipv4": {"type": "string", "format": "ipv4"},
    "enum": {"enum": ["red", "green", 3, None]},
    "const": {"const": "fixed"},
    "minimum/maximum": {"type": "integer", "minimum": -5, "maximum": 20},
    "exclusiveMinimum/Maximum": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 9},
    "multipleOf": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 99},
    "minItems/maxItems": {
        "type": "array",
        "items": {"type": "boolean"},
        "minItems": 1,
        "maxItems": 3,
    },
    "required/additionalProperties": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "anyOf": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    "$ref/$defs": {"$ref": "#/$defs/flag"},
}
DEFS = {"flag": {"type": "boolean"}}
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
ISSUE_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


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
    from daemon.api.codecs.constraints import Constraints
    from daemon.loop.constraint import GrammarConstraint, allocate_bitmask
    from daemon.models.tokenizer import TextTokenizer

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


# ---- every enforced keyword, sampled at temperature 1 (V4 demo path and dense path) --------

SEEDS = (0, 1, 2)
DENSE = "tiny-llama-structured"
DENSE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def dense_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A dense Llama with a chat template: response_format goes by the body's own schema."""
    path = make_dense_checkpoint(
        tmp_path_factory.mktemp("tiny-llama-structured"),
        with_tokenizer=True,
        max_position_embeddings=2048,
    )
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | {"chat_template": DENSE_TEMPLATE}))
    server = LiveServer(
        EngineConfig(
            model=str(path),
            served_model_name=DENSE,
            kv_cache_memory_gb=0.05,
            max_num_seqs=64,
            max_model_len=1024,
            overlap=True,
        ),
        ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1),
    )
    server.start()
    yield server
    server.stop()


def _strict(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": strict}}


def _keyword_schema(prop: dict) -> dict:
    return {
        "type": "object",
        "properties": {"v": prop},
        "required": ["v"],
        "additionalProperties": False,
        "$defs": DEFS,
    }


def _body(model: str, fmt: dict, seed: int | None, max_tokens: int = 80) -> dict:
    body = _chat(fmt, seed, temperature=1.0, max_tokens=max_tokens) | {"model": model}
    return body if model == M else {k: v for k, v in body.items() if k != "thinking"}


def _invalid(schema: dict, choice: dict) -> str | None:
    """Why `choice` does not hold `schema`, or None."""
    text = choice["message"]["content"]
    try:
        assert choice["finish_reason"] == "stop", f"finish_reason {choice['finish_reason']}"
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=FORMATS)
        # (jsonschema checks these formats only with extra packages)
        prop = schema["properties"].get("v", {})
        if prop.get("format") == "date-time":
            datetime.datetime.fromisoformat(value["v"])
        if prop.get("format") == "time":
            datetime.time.fromisoformat(value["v"])
    except (AssertionError, ValueError, jsonschema.ValidationError) as e:
        return f"{text!r}: {e}"
    return None


async def _sample_keywords(url: str, model: str) -> list[str]:
    jobs = [(name, seed) for name in KEYWORDS for seed in SEEDS]
    schemas = {name: _keyword_schema(prop) for name, prop in KEYWORDS.items()}
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(
            *(_post(s, url, _body(model, _strict(schemas[n]), seed)) for n, seed in jobs)
        )
    failures = []
    for (name, seed), a in zip(jobs, answers):
        why = _invalid(schemas[name], a["choices"][0])
        if why is not None:
            failures.append(f"{name} (seed {seed}): {why}")
    return failures


async def test_keyword_table_holds_on_v4(v4_api_server) -> None:
    failures = await _sample_keywords(v4_api_server.base_url + "/chat/completions", M)
    assert not failures, "\n".join(failures)


async def test_keyword_table_holds_on_dense(dense_server) -> None:
    failures = await _sample_keywords(dense_server.base_url + "/chat/completions", DENSE)
    assert not failures, "\n".join(failures)


async def test_the_issue_schema_holds_at_temperature_1(v4_api_server) -> None:
    """strict: the recipe's strict parse dropped maxLength; the body's own schema is enforced."""
    url = v4_api_server.base_url + "/chat/completions"
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(
            *(_post(s, url, _body(M, _strict(ISSUE_SCHEMA), seed, 60)) for seed in range(6))
        )
    for a in answers:
        choice = a["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "length":  # noise may write an endless integer
            assert re.fullmatch(r'\{"name": "[^"]{0,12}", "n": -?[0-9]*', text), text
        else:
            assert _invalid(ISSUE_SCHEMA, choice) is None, text


@pytest.mark.parametrize("server", ["v4_api_server", "dense_server"])
async def test_json_object_is_an_object(request, server: str) -> None:
    live = request.getfixturevalue(server)
    model = M if server == "v4_api_server" else DENSE
    url = live.base_url + "/chat/completions"
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(
            *(_post(s, url, _body(model, {"type": "json_object"}, seed, 8)) for seed in range(8))
        )
    for a in answers:
        text = a["choices"][0]["message"]["content"]
        assert text.startswith("{"), text


UNENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "string", "format": "idn-email"}, "format"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
    ({"type": "integer", "frob": 1}, "frob"),
]


@pytest.mark.parametrize("server", ["v4_api_server", "dense_server"])
@pytest.mark.parametrize(("prop", "keyword"), UNENFORCED)
async def test_strict_schema_with_an_unenforced_keyword_is_400(
    request, server: str, prop: dict, keyword: str
) -> None:
    live = request.getfixturevalue(server)
    model = M if server == "v4_api_server" else DENSE
    body = _body(model, _strict(_keyword_schema(prop)), 0, 4)
    url = live.base_url + "/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
    assert f"'{keyword}'" in err["message"] and "properties.v" in err["message"], err
    assert err["param"] == "response_format"


async def test_not_strict_schema_with_an_unenforced_keyword_is_served(v4_api_server) -> None:
    """Without strict the grammar holds what it can, as vLLM does."""
    body = _body(M, _strict(_keyword_schema({"type": "integer", "frob": 1}), False), 0, 4)
    async with aiohttp.ClientSession() as s:
        await _post(s, v4_api_server.base_url + "/chat/completions", body)


def test_responses_strict_schema_is_enforced_as_written(v4_api_server) -> None:
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0)
    schema = _keyword_schema({"type": "string", "maxLength": 4})
    for seed in range(3):
        r = client.responses.create(
            model=M,
            input="json please",
            text={"format": {"type": "json_schema", "name": "o", "schema": schema, "strict": True}},
            reasoning={"effort": "none"},
            temperature=1.0,
            max_output_tokens=40,
            extra_body={"seed": seed},
        )
        assert r.status == "completed", r
        assert len(json.loads(r.output_text)["v"]) <= 4
    bad = _keyword_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    with pytest.raises(BadRequestError, match="uniqueItems"):
        client.responses.create(
            model=M,
            input="json please",
            text={"format": {"type": "json_schema", "name": "o", "schema": bad, "strict": True}},
            reasoning={"effort": "none"},
            max_output_tokens=4,
        )
