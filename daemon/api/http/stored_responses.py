"""OpenAI's stored responses: `store` and `previous_response_id` on POST /v1/responses (a Turn),
and GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from daemon.api.http.errors import ApiError, bad_request
from daemon.api.http.params import JsonObject, get_bool, get_int, get_str
from daemon.api.http.response_store import ResponseStore, StoredResponse

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

RESPONSE_STORE: web.AppKey[ResponseStore] = web.AppKey("deepinfer_responses", ResponseStore)


@dataclass
class Turn:
    """One POST /v1/responses: the conversation it was generated from, and whether it is kept."""

    store: ResponseStore | None  # None: `store: false` (or the store is off), not kept
    previous_response_id: str | None
    input_items: list[Any]  # earlier turns' input and output items, then this request's input

    @classmethod
    def begin(cls, store: ResponseStore, body: JsonObject) -> tuple[JsonObject, Turn]:
        """The body to convert (with `previous_response_id`, the whole conversation as its
        `input`) and the turn. 400 in OpenAI's shape for an unknown previous response."""
        keep = get_bool(body, "store", True) and store.enabled
        previous = get_str(body, "previous_response_id")
        items = _items(body.get("input"))
        if previous is not None:
            stored = store.get(previous)
            if stored is None:
                raise ApiError(
                    400,
                    f"Previous response with id '{previous}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
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


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.")


def _stored(request: web.Request) -> tuple[str, StoredResponse]:
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSE_STORE].get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return response_id, stored


routes = web.RouteTableDef()


@routes.get("/v1/responses/{response_id}")
async def retrieve(request: web.Request) -> web.Response:
    if request.query.get("stream", "false").lower() == "true":
        raise bad_request("streaming a stored response again is not supported", "stream")
    _, stored = _stored(request)
    return web.Response(body=stored.response, content_type="application/json")


@routes.delete("/v1/responses/{response_id}")
async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSE_STORE].delete(response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


@routes.get("/v1/responses/{response_id}/input_items")
async def input_items(request: web.Request) -> web.Response:
    """OpenAI's cursor page: `limit` (1-100, 20), `order` (desc), `after` / `before` an id."""
    _, stored = _stored(request)
    query: JsonObject = dict(request.query)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"'order' must be 'asc' or 'desc', got {order!r}", "order")
    try:
        query["limit"] = int(query.get("limit", 20))
    except ValueError:
        raise bad_request("'limit' must be an integer", "limit") from None
    limit = get_int(query, "limit", 20, lo=1, hi=100) or 20
    items: list[Any] = orjson.loads(stored.input_items)
    if order == "desc":
        items.reverse()
    ids = [item.get("id") if isinstance(item, dict) else None for item in items]
    start, end = 0, len(items)
    for name in ("after", "before"):
        cursor = query.get(name)
        if cursor is None:
            continue
        if cursor not in ids:
            raise bad_request(f"no input item with id '{cursor}' in this response", name)
        if name == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    window = items[start:end]
    backwards = "before" in query and "after" not in query  # the items just before the cursor
    page = window[-limit:] if backwards else window[:limit]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(window) > limit,
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def register(app: web.Application) -> None:
    app.router.add_routes(routes)
