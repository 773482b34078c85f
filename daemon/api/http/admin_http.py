"""The admin HTTP calls on a node's own port, for a router's autoscaler or an operator:
`POST /admin/v1/role {"role": "prefill" | "decode"}` changes a prefill / decode node's role
live. Served only when `server.admin_token` is set; each call needs `Authorization: Bearer
<token>` (the API key does not open them); errors in OpenAI's error shape."""

from __future__ import annotations

import hmac

import orjson
from aiohttp import web

from daemon.api.http.errors import ApiError, bad_request, unauthorized
from daemon.api.http.state import read_json_object
from daemon.cluster.live_role import RoleChangeError, RoleChanger

PREFIX = "/admin/"
ROLE_PATH = "/admin/v1/role"
_TOKEN: web.AppKey[str] = web.AppKey("deepinfer_admin_token", str)
_CHANGER: web.AppKey[RoleChanger | None] = web.AppKey("deepinfer_role_changer")


def register(app: web.Application, token: str, changer: RoleChanger | None) -> None:
    app[_TOKEN], app[_CHANGER] = token, changer
    app.router.add_post(ROLE_PATH, set_role)


def token_matches(request: web.Request, token: str) -> bool:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() != "bearer ":
        return False
    try:  # bytes that are not UTF-8 arrive as lone surrogates: compare the bytes sent
        given = auth[7:].strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(given, token.encode())


async def set_role(request: web.Request) -> web.Response:
    if not token_matches(request, request.app[_TOKEN]):
        raise unauthorized()
    body = await read_json_object(request)
    return _json(await change_role(request.app[_CHANGER], body))


async def change_role(changer: RoleChanger | None, body: dict) -> dict:
    """The change `body` asks for ({"role"}), shared with the admin socket."""
    if changer is None:
        raise ApiError(409, "only a prefill or decode node changes its role", code="no_role")
    role = body.get("role")
    if not isinstance(role, str):
        raise bad_request("'role' must be prefill or decode", "role")
    try:
        return {"ok": True} | await changer.change(role)
    except RoleChangeError as e:
        if e.code == "bad_role":
            raise bad_request(str(e), "role") from None
        raise ApiError(409, str(e), code=e.code) from None


def _json(body: dict) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")
