"""Bad requests get OpenAI-shaped 4xx errors (never a 500, never a traceback)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from daemon.api.http.errors import error_middleware
from tests.conftest import TINY_MAX_MODEL_LEN, TINY_SERVED_NAME

M = TINY_SERVED_NAME
OK = {"model": M, "prompt": "hello", "max_tokens": 2}
LONG = list(range(10, 10 + TINY_MAX_MODEL_LEN + 10))

# (case id, body: dict -> merged over OK / bytes -> sent raw, status, param)
CASES: list[tuple[str, dict | bytes, int, str | None]] = [
    ("invalid_json", b"{not json", 400, None),
    ("empty_body", b"", 400, None),
    ("body_array", b"[1, 2]", 400, None),
    ("body_string", b'"hello"', 400, None),
    ("missing_model", {"model": None}, 400, "model"),
    ("model_not_string", {"model": 5}, 400, "model"),
    ("unknown_model", {"model": "gpt-17"}, 404, "model"),
    ("missing_prompt", {"prompt": None}, 400, "prompt"),
    ("prompt_int", {"prompt": 5}, 400, "prompt"),
    ("prompt_empty_list", {"prompt": []}, 400, "prompt"),
    ("prompt_empty_string", {"prompt": ""}, 400, "prompt"),
    ("prompt_mixed", {"prompt": [1, "a"]}, 400, "prompt"),
    ("prompt_empty_inner", {"prompt": [[]]}, 400, "prompt"),
    ("prompt_bool_ids", {"prompt": [True, False]}, 400, "prompt"),
    ("prompt_out_of_vocab", {"prompt": [999_999]}, 400, "prompt"),
    ("prompt_negative_id", {"prompt": [-1]}, 400, "prompt"),
    ("prompt_too_long", {"prompt": LONG}, 400, "prompt"),
    ("text_prompt_too_long", {"prompt": "hello " * 2 * TINY_MAX_MODEL_LEN}, 400, "prompt"),
    ("second_prompt_bad", {"prompt": [[5, 6], [999_999]], "n": 2}, 400, "prompt"),
    ("max_tokens_str", {"max_tokens": "a"}, 400, "max_tokens"),
    ("max_tokens_bool", {"max_tokens": True}, 400, "max_tokens"),
    ("max_tokens_float", {"max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens_zero", {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens_negative", {"max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens_over_context", {"max_tokens": TINY_MAX_MODEL_LEN}, 400, "max_tokens"),
    ("temperature_str", {"temperature": "hot"}, 400, "temperature"),
    ("temperature_negative", {"temperature": -0.5}, 400, "temperature"),
    ("top_p_zero", {"top_p": 0}, 400, "top_p"),
    ("top_p_big", {"top_p": 1.5}, 400, "top_p"),
    ("top_k_negative", {"top_k": -2}, 400, "top_k"),
    ("top_k_float", {"top_k": 1.5}, 400, "top_k"),
    ("min_p_big", {"min_p": 2}, 400, "min_p"),
    ("presence_penalty_big", {"presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency_penalty_small", {"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("repetition_penalty_zero", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("seed_str", {"seed": "1"}, 400, "seed"),
    ("stop_int", {"stop": 5}, 400, "stop"),
    ("stop_list_of_ints", {"stop": [1]}, 400, "stop"),
    ("stop_token_ids_bools", {"stop_token_ids": [True]}, 400, "stop_token_ids"),
    ("ignore_eos_str", {"ignore_eos": "yes"}, 400, "ignore_eos"),
    ("logprobs_50", {"logprobs": 50}, 400, "logprobs"),
    ("logprobs_negative", {"logprobs": -1}, 400, "logprobs"),
    ("logprobs_bool", {"logprobs": True}, 400, "logprobs"),
    ("n_zero", {"n": 0}, 400, "n"),
    ("n_too_many", {"n": 17}, 400, "n"),
    ("best_of_not_n", {"best_of": 3}, 400, "best_of"),
    ("echo_str", {"echo": "yes"}, 400, "echo"),
    ("suffix", {"suffix": "tail"}, 400, "suffix"),
    ("stream_str", {"stream": "yes"}, 400, "stream"),
    ("stream_options_int", {"stream": True, "stream_options": 5}, 400, "stream_options"),
    (
        "include_usage_str",
        {"stream": True, "stream_options": {"include_usage": 1}},
        400,
        "include_usage",
    ),
    ("user_int", {"user": 5}, 400, "user"),
    ("priority_str", {"priority": "high"}, 400, "priority"),
    ("traffic_class_unknown", {"traffic_class": "bulk"}, 400, "traffic_class"),
    ("traffic_class_int", {"traffic_class": 3}, 400, "traffic_class"),
    ("cache_salt_empty", {"cache_salt": ""}, 400, "cache_salt"),
    ("cache_salt_int", {"cache_salt": 5}, 400, "cache_salt"),
    ("logit_bias_out_of_range", {"logit_bias": {"5": 101}}, 400, "logit_bias"),
]


async def _call(method: str, url: str, **kwargs: object) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.request(method, url, **kwargs) as r:
        return r.status, await r.text()


def _check_error_shape(status: int, text: str, expected_status: int) -> dict:
    assert status == expected_status, text
    assert "Traceback" not in text and 'File "' not in text
    err = orjson.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


@pytest.mark.parametrize(
    ("body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_bad_request(api_server, body: dict | bytes, status: int, param: str | None) -> None:
    if isinstance(body, dict):
        data = orjson.dumps({k: v for k, v in (OK | body).items() if v is not None})
    else:
        data = body
    headers = {"Content-Type": "application/json"}
    url = api_server.base_url + "/completions"
    err = _check_error_shape(*await _call("POST", url, data=data, headers=headers), status)
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"
    else:
        assert err["type"] == "invalid_request_error"


async def test_rejections_leave_engine_idle(api_server, wait_idle) -> None:
    stats = await wait_idle()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def test_unknown_fields_ignored(api_server) -> None:
    body = OK | {"frobnicate": [1, 2], "x": None}
    status, text = await _call("POST", api_server.base_url + "/completions", json=body)
    assert status == 200, text


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/nope", 404), ("GET", "/v1/completions", 405), ("POST", "/v1/models", 405)],
)
async def test_http_errors_have_error_shape(
    api_server, method: str, path: str, status: int
) -> None:
    _check_error_shape(*await _call(method, api_server.url + path), status)


async def test_body_too_large(api_server) -> None:
    big = orjson.dumps(OK | {"prompt": "x" * (2 << 20)})
    err = _check_error_shape(
        *await _call("POST", api_server.base_url + "/completions", data=big), 413
    )
    assert "too large" in err["message"]


async def test_unexpected_exception_is_500_without_details() -> None:
    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("secret internals /etc/passwd")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/boom", boom)
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/boom")
        err = _check_error_shape(r.status, await r.text(), 500)
    assert err["type"] == "internal_error" and "secret" not in err["message"]
