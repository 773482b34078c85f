"""Stored responses on a tiny DeepSeek-V4 through the official openai SDK: `store`, retrieve,
delete, input_items, chaining with `previous_response_id`, streaming; and the store's bounds."""

from __future__ import annotations

import time

import aiohttp
import openai
import pytest
from openai import OpenAI

from daemon.api.codecs.response_store import ResponseStore
from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.service.settings import ConfigError, load_settings
from tests.conftest import V4_SERVED_NAME, LiveServer

M = V4_SERVED_NAME


@pytest.fixture(scope="module")
def oai(v4_api_server) -> OpenAI:
    return OpenAI(base_url=v4_api_server.base_url, api_key="x", max_retries=0, timeout=60)


def _error(e: openai.APIStatusError) -> dict:
    return e.response.json()["error"]


def test_store_retrieve_delete(oai: OpenAI) -> None:
    r = oai.responses.create(model=M, input="Say hello", max_output_tokens=4)
    assert r.store is True  # OpenAI's default
    got = oai.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    raw = oai.responses.with_raw_response.delete(r.id)
    assert raw.http_response.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.retrieve(r.id)
    assert _error(e.value) == {
        "message": f"Response with id '{r.id}' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(r.id)


def test_previous_response_id_continues_the_conversation(oai: OpenAI) -> None:
    first = oai.responses.create(model=M, input="My name is Ada.", max_output_tokens=4)
    second = oai.responses.create(
        model=M, input="What is my name?", previous_response_id=first.id, max_output_tokens=4
    )
    assert second.previous_response_id == first.id
    alone = oai.responses.create(model=M, input="What is my name?", max_output_tokens=1)
    assert second.usage.input_tokens > alone.usage.input_tokens
    # the model saw exactly the conversation a client would have sent itself
    history = [{"role": "user", "content": "My name is Ada."}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history += [{"role": "user", "content": "What is my name?"}]
    sent = oai.responses.create(model=M, input=history, max_output_tokens=1, store=False)
    assert second.usage.input_tokens == sent.usage.input_tokens
    # and a third turn carries both earlier ones
    third = oai.responses.create(
        model=M, input="And again?", previous_response_id=second.id, max_output_tokens=1
    )
    assert third.usage.input_tokens > second.usage.input_tokens
    items = list(oai.responses.input_items.list(second.id, order="asc"))
    assert items[0].role == "user" and items[0].content[0].text == "My name is Ada."
    assert [i.id for i in items[1:-1]] == [o.id for o in first.output]
    assert items[-1].role == "user" and items[-1].content[0].text == "What is my name?"
    assert all(i.id for i in items)


def test_function_call_output_continues_a_tool_call(oai: OpenAI) -> None:
    """The agent loop: a forced call, then only its output with `previous_response_id`."""
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        }
    ]
    args = dict(model=M, tools=tools, reasoning={"effort": "none"})
    first = oai.responses.create(
        input="Weather in Paris?", tool_choice="required", max_output_tokens=30, **args
    )
    call = next(o for o in first.output if o.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = oai.responses.create(
        input=[output], previous_response_id=first.id, max_output_tokens=2, **args
    )
    assert second.usage.input_tokens > first.usage.input_tokens
    items = list(oai.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].id == call.id and items[2].call_id == call.call_id


def test_input_items_pages(oai: OpenAI) -> None:
    turns = [{"role": "user", "content": f"turn {k}"} for k in range(5)]
    r = oai.responses.create(model=M, input=turns, max_output_tokens=1)
    page = oai.responses.input_items.list(r.id, limit=2)  # newest first by default
    assert [i.content[0].text for i in page.data] == ["turn 4", "turn 3"] and page.has_more
    every = [i.content[0].text for i in oai.responses.input_items.list(r.id, limit=2)]
    assert every == [f"turn {k}" for k in range(4, -1, -1)]  # the SDK follows the cursor
    with pytest.raises(openai.BadRequestError):
        oai.responses.input_items.list(r.id, limit=0)
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_items.list("resp_unknown")


def test_store_false_is_not_kept(oai: OpenAI) -> None:
    r = oai.responses.create(model=M, input="hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=M, input="more", previous_response_id=r.id, max_output_tokens=1)
    assert _error(e.value)["code"] == "previous_response_not_found"


def test_unknown_previous_response_id(oai: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(
            model=M, input="hi", previous_response_id="resp_nope", max_output_tokens=1
        )
    assert e.value.status_code == 400
    assert _error(e.value) == {
        "message": "Previous response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }


@pytest.mark.parametrize(
    "extra,param",
    [({"store": "yes"}, "store"), ({"previous_response_id": 5}, "previous_response_id")],
)
def test_bad_store_fields(oai: OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=M, input="hi", max_output_tokens=1, extra_body=extra)
    assert _error(e.value)["param"] == param


def test_streamed_response_is_stored(oai: OpenAI) -> None:
    events = list(oai.responses.create(model=M, input="hi", max_output_tokens=4, stream=True))
    assert events[0].response.store is True
    final = events[-1].response
    assert final.store is True and final.output
    assert oai.responses.retrieve(final.id).model_dump() == final.model_dump()
    chained = list(
        oai.responses.create(
            model=M, input="go on", previous_response_id=final.id, max_output_tokens=2, stream=True
        )
    )[-1].response
    assert chained.previous_response_id == final.id
    assert chained.usage.input_tokens > final.usage.input_tokens
    assert oai.responses.retrieve(chained.id).previous_response_id == final.id


# ---- the store's bounds -----------------------------------------------------------------


@pytest.fixture(scope="module")
def small_store_server(v4_model_dir):
    engine_cfg = EngineConfig(
        model=str(v4_model_dir),
        served_model_name=M,
        kv_cache_memory_gb=0.05,
        max_num_seqs=4,
        overlap=True,
        max_model_len=4096,
    )
    server_cfg = ServerConfig(
        host="127.0.0.1", port=0, shutdown_timeout=1, response_store_max_count=2,
        response_store_ttl_s=1.0,
    )  # fmt: skip
    server = LiveServer(engine_cfg, server_cfg)
    server.start()
    yield server
    server.stop()


def test_server_store_evicts_and_expires(small_store_server) -> None:
    client = OpenAI(base_url=small_store_server.base_url, api_key="x", max_retries=0)
    ids = [client.responses.create(model=M, input="hi", max_output_tokens=1).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the least recently used of three, over a count of 2
    assert client.responses.retrieve(ids[2]).id == ids[2]
    time.sleep(1.1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[2])


def test_store_lru_bytes_and_ttl() -> None:
    now = [0.0]
    store = ResponseStore(max_count=3, max_bytes=100, ttl_s=10.0, clock=lambda: now[0])
    for k in "abc":
        assert store.put(k, b"x" * 20, b"[]")
    assert store.get("a") is not None  # a use: "b" is now the least recently used
    assert store.put("d", b"x" * 20, b"[]")
    assert store.get("b") is None and len(store) == 3
    assert store.put("e", b"x" * 50, b"[]")  # over 100 bytes: the oldest go until it fits
    assert store.bytes <= 100 and store.get("e") is not None and store.get("c") is None
    assert not store.put("huge", b"x" * 101, b"")
    now[0] = 9.0
    assert store.get("e") is not None  # renewed until 19
    now[0] = 12.0
    assert store.get("a") is None and store.get("e") is not None
    now[0] = 40.0
    assert store.get("e") is None and len(store) == 0 and store.bytes == 0
    assert store.delete("e") is False


def test_store_settings_checked() -> None:
    for key, value in [("response_store_max_count", -1), ("response_store_ttl_s", 0)]:
        with pytest.raises(ConfigError, match=key):
            load_settings(overrides={"server": {key: value}})
    server = load_settings(overrides={"server": {"response_store_memory_gb": 0}}).server
    assert server.response_store_memory_gb == 0.0


async def test_malformed_requests_are_400(v4_api_server, oai: OpenAI) -> None:
    first = oai.responses.create(model=M, input="hi", max_output_tokens=1)
    base = v4_api_server.base_url + "/responses"
    posts = [
        {"input": 5, "previous_response_id": first.id},
        {"input": [7, "x"], "previous_response_id": first.id},
        {"input": "hi", "previous_response_id": ""},
    ]
    gets = ["limit=abc", "limit=101", "order=up", "after=msg_unknown", "before=msg_unknown"]
    async with aiohttp.ClientSession() as s:
        for body in posts:
            async with s.post(base, json={"model": M, "max_output_tokens": 1, **body}) as r:
                assert r.status == 400, body
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        for query in gets:
            async with s.get(f"{base}/{first.id}/input_items?{query}") as r:
                assert r.status == 400, query
                assert (await r.json())["error"]["message"]
        async with s.get(f"{base}/{first.id}?stream=true") as r:
            assert r.status == 400
