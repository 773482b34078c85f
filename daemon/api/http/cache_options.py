"""Per-request prefix-cache options: the traffic class (block-store retention) and the
tenant's cache salt (requests with different salts never share KV)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from daemon.api.codecs.base import JsonObject
from daemon.api.codecs.params import get_str
from daemon.api.http.errors import bad_request
from daemon.kv.traffic import DEFAULT_CLASS
from daemon.loop.engine import Engine

TRAFFIC_CLASS_HEADER = "X-Traffic-Class"
MAX_SALT_CHARS = 1024


@dataclass(frozen=True)
class CacheOptions:
    traffic_class: str = DEFAULT_CLASS
    cache_salt: bytes = b""


def cache_options(request: web.Request, body: JsonObject, engine: Engine) -> CacheOptions:
    """From the body's `traffic_class` (or the X-Traffic-Class header) and `cache_salt`."""
    traffic_class = get_str(body, "traffic_class") or request.headers.get(TRAFFIC_CLASS_HEADER)
    classes = engine.traffic_classes
    if traffic_class is None:
        traffic_class = classes.default if classes else DEFAULT_CLASS
    elif classes is not None and traffic_class not in classes:
        raise bad_request(
            f"unknown traffic_class {traffic_class!r}; this server has {', '.join(classes.names())}",
            "traffic_class",
        )
    salt = get_str(body, "cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_SALT_CHARS:
        raise bad_request(
            f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} characters",
            "cache_salt",
        )
    return CacheOptions(traffic_class, salt.encode() if salt else b"")
