"""Optional API-key check: `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's)."""

from __future__ import annotations

import hmac

from aiohttp import web

from daemon.api.http.errors import Handler, unauthorized
from daemon.api.http.state import STATE

OPEN_PATHS = ("/health",)
ADMIN_PREFIX = "/admin/"  # the admin HTTP calls check their own token (api/http/admin_http.py)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if (
        key
        and request.path not in OPEN_PATHS
        and not request.path.startswith(ADMIN_PREFIX)
        and not key_matches(request, key)
    ):
        raise unauthorized()
    return await handler(request)


def key_matches(request: web.Request, key: str) -> bool:
    given = request.headers.get("x-api-key")
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    if given is None:
        return False
    try:  # aiohttp keeps bytes that are not UTF-8 as lone surrogates: compare the bytes sent
        raw = given.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(raw, key.encode())
