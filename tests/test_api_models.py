"""GET /v1/models, /v1/models/{id} and /health."""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp
from openai import OpenAI

from daemon.api.codecs.completions import CompletionsCodec
from daemon.api.http.models import DEMO_DESCRIPTION, model_card
from daemon.api.http.state import ApiState, Codecs
from tests.conftest import TINY_MAX_MODEL_LEN


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


async def test_models_list(api_server) -> None:
    status, body = await _get(api_server.base_url + "/models")
    assert status == 200 and body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == api_server.model and card["object"] == "model"
    assert card["owned_by"] == "deepinfer" and isinstance(card["created"], int)
    assert card["max_model_len"] == TINY_MAX_MODEL_LEN
    assert card["deepinfer_demo"] is False and "description" not in card


def test_models_via_sdk(api_server) -> None:
    client = OpenAI(base_url=api_server.base_url, api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == [api_server.model]
    assert client.models.retrieve(api_server.model).id == api_server.model


async def test_model_retrieve_unknown(api_server) -> None:
    status, body = await _get(api_server.base_url + "/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_demo_model_card() -> None:
    engine = SimpleNamespace(max_model_len=4096)
    codecs = Codecs(CompletionsCodec(None, "demo"))
    card = model_card(ApiState(engine, "demo", demo=True, created=1, codecs=codecs))  # type: ignore[arg-type]
    assert card["deepinfer_demo"] is True and card["description"] == DEMO_DESCRIPTION


async def test_health(api_server) -> None:
    status, body = await _get(api_server.url + "/health")
    assert status == 200 and body["status"] == "ok"
    assert {"running", "waiting", "kv_blocks_free", "kv_blocks_total"} <= set(body)
    assert 0 <= body["kv_blocks_free"] <= body["kv_blocks_total"]
