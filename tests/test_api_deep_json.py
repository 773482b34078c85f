"""JSON nested deeper than the codec can take, anywhere in a body, is a 400 in each protocol's
error shape on every route that reads a body (never a RecursionError's 500)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from daemon.api.http.state import MAX_JSON_DEPTH
from tests.conftest import TINY_SERVED_NAME, V4_SERVED_NAME
from tests.test_api_conversation_errors import assert_error_shape

DEEP = "<deep>"


def nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def with_deep(body: dict, depth: int) -> bytes:
    """`body` as JSON with DEEP replaced by `depth` nested arrays (orjson writes 254 at most)."""
    return orjson.dumps(body).replace(orjson.dumps(DEEP), b"[" * depth + b'"x"' + b"]" * depth)


def v4_bodies(deep: object) -> dict[str, dict]:
    user = [{"role": "user", "content": "hi"}]
    m = V4_SERVED_NAME
    tool = {"type": "object", "properties": {"a": deep}}
    return {
        "/v1/chat/completions": {
            "model": m,
            "messages": user,
            "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": tool}}],
        },
        "/v1/responses": {"model": m, "input": "hi", "max_output_tokens": 2, "metadata": deep},
        "/v1/messages": {
            "model": m,
            "messages": user,
            "max_tokens": 2,
            "tools": [{"name": "f", "input_schema": tool}],
        },
        "/v1/completions": {"model": m, "prompt": "hi", "max_tokens": 2, "stop": deep},
        "/tokenize": {"model": m, "messages": user, "x": deep},
    }


async def _post(url: str, data: bytes) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 129, 300, 1020])
@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions", "/tokenize"],
)
async def test_deep_json_is_a_400(v4_api_server, path: str, depth: int) -> None:
    body = v4_bodies(DEEP)[path]
    status, payload = await _post(v4_api_server.url + path, with_deep(body, depth))
    assert status == 400, payload
    assert_error_shape(path, 400, payload)
    message = payload["error"]["message"]
    assert "nested" in message or "schema" in message or "must" in message, message


async def test_the_deepest_body_allowed_is_served(v4_api_server) -> None:
    """A body exactly MAX_JSON_DEPTH deep passes the body check and reaches the codec."""
    body = v4_bodies(None)["/v1/responses"] | {"metadata": nested(MAX_JSON_DEPTH - 1)}
    status, payload = await _post(v4_api_server.url + "/v1/responses", orjson.dumps(body))
    assert status in (200, 400), payload
    if status == 400:
        assert "nested" not in payload["error"]["message"]


async def test_deep_json_on_the_dense_server(api_server) -> None:
    user = [{"role": "user", "content": "hi"}]
    for path, body in (
        ("/v1/chat/completions", {"model": TINY_SERVED_NAME, "messages": user, "x": DEEP}),
        ("/v1/completions", {"model": TINY_SERVED_NAME, "prompt": DEEP}),
    ):
        status, payload = await _post(api_server.url + path, with_deep(body, 500))
        assert status == 400, payload
        assert "nested" in payload["error"]["message"]
