"""A seeded fuzz of the four generation endpoints on a DeepSeek-V4 server, a dense one and a
dense one with a chat template: bodies mutated in type (every known field), depth, size and
unicode (raw invalid bytes too), with fields deleted and duplicated and odd schemas in tools
and structured output, never get a 5xx, and every error comes in its protocol's shape."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.models.checkpoints import make_dense_checkpoint
from daemon.service.live_server import LiveServer
from tests.conftest import TINY_SERVED_NAME, V4_SERVED_NAME

# (a longer hunt: DEEPINFER_FUZZ_SEED=... DEEPINFER_FUZZ_BODIES=500)
SEED = int(os.environ.get("DEEPINFER_FUZZ_SEED", "20261201"))
# random bodies per endpoint and server; then each known field once with a wrong type
BODIES_PER_ENDPOINT = int(os.environ.get("DEEPINFER_FUZZ_BODIES", "32"))
TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
    "required": ["city"],
}


def bases(model: str) -> dict[str, dict]:
    """A valid body per endpoint using most known fields (max_tokens small)."""
    return {
        "/v1/completions": {
            "model": model, "prompt": "Hello there", "max_tokens": 2, "temperature": 0.7,
            "top_p": 0.9, "top_k": 20, "n": 1, "stop": ["\n"], "seed": 3, "logprobs": 2,
            "echo": False, "presence_penalty": 0.1, "frequency_penalty": 0.1, "stream": False,
            "stream_options": {"include_usage": True}, "user": "u", "ignore_eos": False,
        },
        "/v1/chat/completions": {
            "model": model, "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "seed": 1,
            "n": 1, "stop": ["END"], "logprobs": True, "top_logprobs": 2, "stream": False,
            "max_completion_tokens": 2, "parallel_tool_calls": True, "tool_choice": "auto",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "And tomorrow?"},
            ],
            "tools": [{"type": "function", "function": {
                "name": "weather", "description": "w", "parameters": TOOL_SCHEMA,
            }}],
            "response_format": {"type": "text"},
        },
        "/v1/responses": {
            "model": model, "max_output_tokens": 2, "temperature": 0.5, "top_p": 0.9,
            "instructions": "Be brief.", "stream": False, "store": False,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "weather",
                 "arguments": '{"city": "Lima"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            ],
            "tools": [{"type": "function", "name": "weather", "parameters": TOOL_SCHEMA}],
            "tool_choice": "auto", "text": {"format": {"type": "text"}},
            "reasoning": {"effort": "low"}, "metadata": {"k": "v"},
        },
        "/v1/messages": {
            "model": model, "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["END"],
            "stream": False, "metadata": {"user_id": "u"},
            "messages": [
                {"role": "user", "content": "Weather in Tokyo?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Tokyo"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "snow"},
                    {"type": "text", "text": "thanks"},
                ]},
            ],
            "tools": [{"name": "weather", "description": "w", "input_schema": TOOL_SCHEMA}],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "disabled"},
        },
    }  # fmt: skip


WRONG = [
    None, True, False, 0, -1, 1.5, -1e308, 2**63, "", "x", [], {}, [1, "a"], {"a": 1},
    "\u202eRTL\u202c", "a\x00b", "\u0000", "<｜end▁of▁sentence｜>", "<think>", "\ufeff", "😀" * 3,
]  # fmt: skip
UNICODE = ["\u202e\u2066x\u2069", "\x00", "e\u0301\u0301", "\U0010ffff", "\ud7ff", "<｜User｜>"]
# raw byte strings spliced over a string value: lone surrogates, invalid UTF-8, escaped NUL
RAW = [b'"\\ud800"', b'"a\\udc00b"', b'"\xed\xa0\x80"', b'"\xff\xfe"', b'"\\u0000"', b'"\xc3"']
MARK = "\u2063mark\u2063"
CLIENT_TIMEOUT_S = 30
LENGTH_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


# schemas for tools and structured output that a grammar compiler may choke on
SCHEMAS = [
    {"type": "string", "pattern": "("}, {"type": "string", "pattern": "a{99999}"},
    {"type": "integer", "minimum": 5, "maximum": 1}, {"enum": []}, {"$ref": "#/$defs/nope"},
    {"type": "array", "minItems": 10**9}, {"type": "string", "maxLength": -1}, {"anyOf": []},
    {"type": ["string", "null"]}, {"type": "string", "format": "email"}, {"not": {}},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"const": {"a": [1, None]}}, {"type": "number", "multipleOf": 0}, {"type": "frob"},
    {"type": "object", "additionalProperties": False, "required": ["missing"]},
    {"type": "string", "enum": ["a" * 5000]}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "object", "patternProperties": {"(": {}}}, True, False, [], "string",
]  # fmt: skip


def with_schema(rng: random.Random, body: dict) -> None:
    """A weird schema in a tool, or as structured output (strict or not)."""
    schema = copy.deepcopy(rng.choice(SCHEMAS))
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict) and rng.random() < 0.5:
        holder = tools[0].get("function", tools[0])
        if isinstance(holder, dict):
            holder["input_schema" if "input_schema" in holder else "parameters"] = schema
            return
    named = {"name": "out", "schema": schema, "strict": rng.random() < 0.5}
    if "messages" in body and "system" not in body:  # chat completions
        body["response_format"] = {"type": "json_schema", "json_schema": named}
    elif "input" in body:
        body["text"] = {"format": {"type": "json_schema", **named}}


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths(v, (*prefix, i))
    return out


def parent(body: Any, path: tuple) -> Any:
    for step in path[:-1]:
        body = body[step]
    return body


def mutate(rng: random.Random, base: dict, bounded: bool) -> bytes:
    """`bounded`: an output length field deleted or nulled is put back (Messages requires
    max_tokens: there its absence must be a 400)."""
    body = copy.deepcopy(base)
    if rng.random() < 0.3:
        body["stream"] = True
    if rng.random() < 0.25:
        with_schema(rng, body)
    raw_splice: bytes | None = None
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        kind = rng.choice(["type", "type", "delete", "duplicate", "deep", "size", "unicode", "raw"])
        candidates = paths(body)
        if kind in ("size", "unicode"):  # mostly into text, where weird text is still valid
            texts = [p for p in candidates if isinstance(parent(body, p)[p[-1]], str)]
            candidates = texts if texts and rng.random() < 0.8 else candidates
        where = rng.choice(candidates)
        holder, last = parent(body, where), where[-1]
        if kind == "type":
            holder[last] = copy.deepcopy(rng.choice(WRONG))
        elif kind == "delete":
            del holder[last]
        elif kind == "duplicate":
            if isinstance(holder, list):
                holder.insert(last, copy.deepcopy(holder[last]))
            else:
                holder[last] = [copy.deepcopy(holder[last])] * rng.choice([2, 50])
        elif kind == "deep":
            holder[last] = MARK
            depth = rng.choice([60, 127, 129, 200, 600, 1100])
            raw_splice = b"[" * depth + b"1" + b"]" * depth
        elif kind == "size":
            holder[last] = rng.choice(["y" * rng.choice([5000, 200_000]), list(range(20_000))])
        elif kind == "unicode":
            text = holder[last] if isinstance(holder[last], str) else ""
            cut = rng.randrange(len(text) + 1)
            holder[last] = text[:cut] + rng.choice(UNICODE) * rng.choice([1, 3]) + text[cut:]
        else:
            holder[last] = MARK
            raw_splice = rng.choice(RAW)
        if not body:
            break
    for key in LENGTH_KEYS:  # absent, these mean "up to the context's end": seconds of output
        if bounded and key in base and isinstance(body, dict) and body.get(key) is None:
            body[key] = 2
    data = orjson.dumps(body)
    if raw_splice is not None:
        data = data.replace(orjson.dumps(MARK), raw_splice)
    return data


def wrong_type(rng: random.Random, base: dict, where: tuple, bounded: bool) -> bytes:
    body = copy.deepcopy(base)
    value = parent(body, where)[where[-1]]
    wrong = [w for w in WRONG if type(w) is not type(value)]
    parent(body, where)[where[-1]] = copy.deepcopy(rng.choice(wrong))
    for key in LENGTH_KEYS:
        if bounded and key in base and body.get(key) is None:
            body[key] = 2
    return orjson.dumps(body)


def check_shape(path: str, status: int, text: str) -> str | None:
    """What is wrong with the answer, or None."""
    if status >= 500:
        return f"status {status}"
    if "Traceback" in text:
        return "a traceback in the body"
    if status < 400:
        return None
    try:
        payload = orjson.loads(text)
    except orjson.JSONDecodeError:
        return "an error body that is not JSON"
    if path == "/v1/messages":
        err = payload.get("error") if payload.get("type") == "error" else None
        ok = isinstance(err, dict) and {"type", "message"} <= set(err)
    else:
        err = payload.get("error")
        ok = isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
    if not ok or not isinstance(err.get("message"), str) or not err["message"]:
        return f"an error body not in the protocol's shape: {text[:200]}"
    return None


async def fuzz(url: str, model: str) -> tuple[list[str], Counter[int]]:
    rng = random.Random(f"{SEED}-{model}")
    jobs = [
        (path, mutate(rng, base, path != "/v1/messages"))
        for path, base in bases(model).items()
        for _ in range(BODIES_PER_ENDPOINT)
    ]
    jobs += [  # and every known field, at any depth, once with a wrong type
        (path, wrong_type(rng, base, where, path != "/v1/messages"))
        for path, base in bases(model).items()
        for where in paths(base)
    ]
    limit = asyncio.Semaphore(8)
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)

    async def send(session: aiohttp.ClientSession, path: str, data: bytes) -> None:
        async with limit:
            try:
                async with session.post(url + path, data=data, headers=HEADERS) as r:
                    status, kind = r.status, r.content_type
                    text = (await r.read()).decode("utf-8", "replace")
            except TimeoutError:
                status, kind, text = 0, "", ""
        statuses[status] += 1
        problem = (
            check_shape(path, status, text) if status else f"no answer within {CLIENT_TIMEOUT_S} s"
        )
        streamed = status == 200 and kind == "text/event-stream"
        if problem is None and streamed and ('"internal_error"' in text or '"api_error"' in text):
            problem = "an internal error in the stream"
        if problem:
            failures.append(f"{path} {problem}\n  body: {data[:600]!r}\n  answer: {text[:300]}")

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(send(session, path, data) for path, data in jobs))
    return failures, statuses


HEADERS = {"Content-Type": "application/json"}


# a Qwen-like template: tools as Hermes <tool_call> blocks
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    '</tools>Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>{% endif %}'
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}"
    "{% for tc in m['tool_calls'] or [] %}<tool_call>{{ tc['function'] | tojson }}</tool_call>"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DENSE_CHAT = "tiny-qwen-chat"


@pytest.fixture(scope="module")
def dense_chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = make_dense_checkpoint(
        tmp_path_factory.mktemp("fuzz-chat"), with_tokenizer=True, max_position_embeddings=2048
    )
    cfg_path = path / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"chat_template": TEMPLATE}))
    engine = EngineConfig(
        model=str(path), served_model_name=DENSE_CHAT, kv_cache_memory_gb=0.05,
        max_num_seqs=16, max_model_len=1024, overlap=True,
    )  # fmt: skip
    server = LiveServer(engine, ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1))
    server.start()
    yield server
    server.stop()


SERVERS = {
    "v4": ("v4_api_server", V4_SERVED_NAME),
    "dense": ("api_server", TINY_SERVED_NAME),  # completions (no chat template)
    "dense-chat": ("dense_chat_server", DENSE_CHAT),  # chat through a jinja template
}


@pytest.mark.parametrize("which", list(SERVERS))
async def test_fuzzed_bodies_get_no_5xx(request, which: str) -> None:
    fixture, model = SERVERS[which]
    server = request.getfixturevalue(fixture)
    failures, statuses = await fuzz(server.url, model)
    print(which, "statuses:", dict(sorted(statuses.items())))
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures)
    async with aiohttp.ClientSession() as s:  # and nothing was left running
        for _ in range(200):
            async with s.get(server.url + "/health") as r:
                health = await r.json()
            if health["running"] == health["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
    assert health["running"] == health["waiting"] == 0, health
