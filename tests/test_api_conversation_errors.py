"""Bad input to /v1/chat/completions, /v1/responses, /v1/messages, /tokenize and /detokenize:
the right status and each protocol's error shape; API keys and 429 on overload."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from tests.conftest import V4_SERVED_NAME, LiveServer

M = V4_SERVED_NAME
USER = [{"role": "user", "content": "hi"}]
OK = {
    "/v1/chat/completions": {"model": M, "messages": USER, "max_tokens": 2},
    "/v1/responses": {"model": M, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": M, "messages": USER, "max_tokens": 2},
}
COMMON: list[tuple[str, dict | bytes, int]] = [
    ("invalid_json", b"{not json", 400),
    ("empty_body", b"", 400),
    ("body_array", b"[1, 2]", 400),
    ("missing_model", {"model": None}, 400),
    ("model_not_string", {"model": 5}, 400),
    ("unknown_model", {"model": "gpt-17"}, 404),
    ("temperature_string", {"temperature": "hot"}, 400),
    ("stream_not_bool", {"stream": "yes"}, 400),
    ("too_large", b'{"model": "' + b"x" * (2 << 20) + b'"}', 413),
]
PER_ENDPOINT: dict[str, list[tuple[str, dict | bytes, int]]] = {
    "/v1/chat/completions": [
        ("missing_messages", {"messages": None}, 400),
        ("empty_messages", {"messages": []}, 400),
        ("bad_role", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("max_tokens_over_context", {"max_tokens": 10_000_000}, 400),
        ("json_object_without_json", {"response_format": {"type": "json_object"}}, 400),
        ("tool_not_object", {"tools": [5]}, 400),
        ("max_completion_tokens_string", {"max_completion_tokens": "3"}, 400),
        ("stream_options_not_object", {"stream": True, "stream_options": 5}, 400),
    ],
    "/v1/responses": [
        ("missing_input", {"input": None}, 400),
        ("input_number", {"input": 5}, 400),
        ("max_output_tokens_over_context", {"max_output_tokens": 10_000_000}, 400),
    ],
    "/v1/messages": [
        ("missing_messages", {"messages": None}, 400),
        ("empty_messages", {"messages": []}, 400),
        ("bad_role", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("missing_max_tokens", {"max_tokens": None}, 400),
        ("max_tokens_string", {"max_tokens": "5"}, 400),
    ],
}
CASES = [
    pytest.param(path, body, status, id=f"{path.rsplit('/', 1)[-1]}-{name}")
    for path in OK
    for name, body, status in COMMON + PER_ENDPOINT[path]
]


def _merged(path: str, body: dict | bytes) -> bytes:
    import orjson

    if isinstance(body, bytes):
        return body
    merged = {k: v for k, v in (OK[path] | body).items() if v is not None}
    return orjson.dumps(merged)


def assert_error_shape(path: str, status: int, payload: dict) -> None:
    if path == "/v1/messages":
        assert payload["type"] == "error", payload
        assert isinstance(payload["error"]["type"], str) and payload["error"]["message"]
        expected = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}
        assert payload["error"]["type"] == expected.get(status, payload["error"]["type"])
    else:
        err = payload["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in str(payload)


@pytest.mark.parametrize("path,body,status", CASES)
async def test_bad_input(v4_api_server, path: str, body: dict | bytes, status: int) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            v4_api_server.url + path,
            data=_merged(path, body),
            headers={"Content-Type": "application/json"},
        ) as r,
    ):
        assert r.status == status, await r.text()
        assert_error_shape(path, status, await r.json())


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/tokenize", {"prompt": 5}, 400),
        ("/tokenize", {}, 400),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
        ("/tokenize", {"messages": []}, 400),
        ("/detokenize", {"tokens": "abc"}, 400),
        ("/detokenize", {"tokens": [10**9]}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
    ],
)
async def test_tokenize_bad_input(v4_api_server, path: str, body: dict, status: int) -> None:
    async with aiohttp.ClientSession() as s, s.post(v4_api_server.url + path, json=body) as r:
        assert r.status == status
        assert_error_shape(path, status, await r.json())


async def test_tokenize_roundtrip(v4_api_server) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            v4_api_server.url + "/tokenize",
            json={"model": M, "prompt": "Hello world", "return_token_strs": True},
        ) as r:
            tok = await r.json()
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 4096
        assert "".join(tok["token_strs"]).endswith("Hello world")
        async with s.post(v4_api_server.url + "/detokenize", json={"tokens": tok["tokens"]}) as r:
            assert (await r.json())["prompt"].endswith("Hello world")
        async with s.post(v4_api_server.url + "/tokenize", json={"messages": USER}) as r:
            chat = await r.json()
        body = OK["/v1/chat/completions"]
        async with s.post(v4_api_server.url + "/v1/chat/completions", json=body) as r:
            assert (await r.json())["usage"]["prompt_tokens"] == chat["count"]


# ---- API keys and overload ------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_server(v4_model_dir):
    engine_cfg = EngineConfig(
        model=str(v4_model_dir),
        served_model_name=M,
        kv_cache_memory_gb=0.05,
        max_num_seqs=1,
        overlap=True,
        max_model_len=4096,
    )
    server_cfg = ServerConfig(
        host="127.0.0.1", port=0, shutdown_timeout=1, api_key="sekrit", max_waiting=1
    )
    server = LiveServer(engine_cfg, server_cfg)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize(
    "path,headers,status",
    [
        ("/v1/chat/completions", {}, 401),
        ("/v1/chat/completions", {"Authorization": "Bearer wrong"}, 401),
        ("/v1/chat/completions", {"Authorization": "Bearer sekrit"}, 200),
        ("/v1/messages", {"x-api-key": "sekrit"}, 200),
        ("/v1/messages", {"x-api-key": "nope"}, 401),
        ("/v1/models", {}, 401),
    ],
)
async def test_api_key(guarded_server, path: str, headers: dict, status: int) -> None:
    body = OK.get(path)
    async with aiohttp.ClientSession() as s:
        method = s.post if body else s.get
        async with method(guarded_server.url + path, json=body, headers=headers) as r:
            assert r.status == status
            if status == 401:
                assert_error_shape(path, status, await r.json())
        async with s.get(guarded_server.url + "/health") as r:
            assert r.status == 200


async def test_overload_429(guarded_server) -> None:
    long = {"model": M, "messages": USER, "max_tokens": 3000, "stream": True}
    auth = {"Authorization": "Bearer sekrit"}
    async with aiohttp.ClientSession() as s:
        first = await s.post(guarded_server.url + "/v1/chat/completions", json=long, headers=auth)
        await first.content.readline()  # running
        second = asyncio.ensure_future(
            s.post(guarded_server.url + "/v1/chat/completions", json=long, headers=auth)
        )
        for _ in range(100):  # until the second one waits
            async with s.get(guarded_server.url + "/health") as r:
                if (await r.json())["waiting"] >= 1:
                    break
            await asyncio.sleep(0.02)
        url = guarded_server.url + "/v1/messages"
        async with s.post(url, json=OK["/v1/messages"], headers=auth) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["type"] == "rate_limit_error"
        first.close()
        second.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            (await second).close()
        for _ in range(200):  # both clients gone: the server frees their requests
            async with s.get(guarded_server.url + "/health") as r:
                health = await r.json()
            if health["running"] == health["waiting"] == 0:
                break
            await asyncio.sleep(0.02)
        assert health["running"] == health["waiting"] == 0
