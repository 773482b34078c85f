"""GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items: the responses kept
by `store` (codecs/recipe/turn.py keeps them)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from daemon.api.codecs.base import JsonObject
from daemon.api.codecs.params import get_int
from daemon.api.codecs.response_store import ResponseStore, StoredResponse
from daemon.api.http.errors import ApiError, bad_request

RESPONSE_STORE: web.AppKey[ResponseStore] = web.AppKey("deepinfer_responses", ResponseStore)


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
