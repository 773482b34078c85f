"""OpenAI's stored responses on POST /v1/responses: `store` keeps a response (a Turn), and
`previous_response_id` continues the conversation of a kept one."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from daemon.api.codecs.base import CodecError, JsonObject
from daemon.api.codecs.params import get_bool, get_str
from daemon.api.codecs.response_store import ResponseStore, StoredResponse

# stream events that carry the whole response object; the last of a stream is the final one
_RESPONSE_EVENTS = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    }
)
_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}


@dataclass
class Turn:
    """One POST /v1/responses: the conversation it was generated from, and whether it is kept."""

    store: ResponseStore | None  # None: `store: false` (or the store is off), not kept
    previous_response_id: str | None
    input_items: list[Any]  # earlier turns' input and output items, then this request's input

    @classmethod
    def begin(cls, store: ResponseStore, body: JsonObject) -> tuple[JsonObject, Turn]:
        """The body to convert (with `previous_response_id`, the whole conversation as its
        `input`) and the turn. CodecError for an unknown previous response."""
        keep = get_bool(body, "store", True) and store.enabled
        previous = get_str(body, "previous_response_id")
        items = _items(body.get("input"))
        if previous is not None:
            stored = store.get(previous)
            if stored is None:
                raise CodecError(
                    f"Previous response with id '{previous}' not found.",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            items = _history(stored) + items
            # instructions and tools are the new request's own, as OpenAI does; an `input` of a
            # wrong type stays as it is, for the recipe to refuse
            if body.get("input") is None or isinstance(body["input"], str | list):
                body = {k: v for k, v in body.items() if k != "previous_response_id"}
                body["input"] = items
        return body, cls(store if keep else None, previous, items)

    def finish(self, response_json: str) -> str:
        """The whole response as answered (and kept, if it is to be)."""
        response = self._patched(orjson.loads(response_json))
        data = orjson.dumps(response)
        self._keep(response, data)
        return data.decode()

    def event(self, name: str | None, event_json: str) -> str:
        """A stream event as sent; the final one's response is kept."""
        if name not in _RESPONSE_EVENTS:
            return event_json
        event = orjson.loads(event_json)
        if not isinstance(event.get("response"), dict):
            return event_json
        response = self._patched(event["response"])
        if name in _FINAL_EVENTS:
            self._keep(response, orjson.dumps(response))
        return orjson.dumps(event).decode()

    def _patched(self, response: JsonObject) -> JsonObject:
        response["store"] = self.store is not None
        response["previous_response_id"] = self.previous_response_id
        return response

    def _keep(self, response: JsonObject, data: bytes) -> None:
        if self.store is not None:
            self.store.put(response["id"], data, orjson.dumps(self.input_items))


def _history(stored: StoredResponse) -> list[Any]:
    return orjson.loads(stored.input_items) + orjson.loads(stored.response)["output"]


def _items(value: object) -> list[Any]:
    """`input` as input items with ids, as input_items lists them (the recipe reads both forms
    alike). Anything malformed is left as it is, for the recipe to refuse."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        return []
    return [_item(item) if isinstance(item, dict) else item for item in value]


def _item(item: JsonObject) -> JsonObject:
    item = dict(item)
    if "role" in item and "type" not in item:
        item["type"] = "message"
    kind = item.get("type")
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        item["content"] = [{"type": part, "text": item["content"]}]
    if "id" not in item:
        prefix = _ID_PREFIXES.get(kind, "item_") if isinstance(kind, str) else "item_"
        item["id"] = prefix + uuid.uuid4().hex
    return item
