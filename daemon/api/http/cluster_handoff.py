"""A node's part in KV handoffs: on a prefill node `POST /cluster/v1/prefill` (compute a prompt,
stream its KV state in the wire format); on a decode node the KVSource a routed request's
engine job fetches its prompt's KV with. Both roles serve both, each admitted by the node's
live role (it can change: `cluster/live_role.py`) and counted while it runs."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import aiohttp
import structlog
from aiohttp import web

from daemon.api.http.cache_options import CacheOptions
from daemon.api.http.errors import ApiError, bad_request, unavailable
from daemon.api.http.state import get_state, read_json_object
from daemon.cluster.kv_source import PREFILL_PATH, HttpKVSource
from daemon.cluster.live_role import LiveRole
from daemon.cluster.wire import CONTENT_TYPE, HandoffMeta, encode, prefix_hash
from daemon.loop.engine import RequestRejected
from daemon.loop.handoff import HandoffFailed, KVSource, StoreOffer

log = structlog.get_logger(__name__)

ROUTER_HEADER = "x-deepinfer-router"
HANDOFF_HEADER = "x-deepinfer-handoff-id"
HANDOFF_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
MAX_LEASE_MS = 3_600_000


@dataclass(frozen=True)
class HandoffConfig:
    """This node in handoffs: its live role, model fingerprint and epoch, the routers it takes
    routed requests from (its --peers), the fetch's whole timeout, the key peers want."""

    role: LiveRole
    fingerprint: str
    epoch: int
    routers: tuple[str, ...] = ()
    timeout_s: float = 30.0
    api_key: str | None = field(default=None, repr=False)


HANDOFF: web.AppKey[HandoffConfig] = web.AppKey("deepinfer_handoff", HandoffConfig)
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("deepinfer_handoff_session")


def register(app: web.Application, cfg: HandoffConfig) -> None:
    app[HANDOFF] = cfg
    app.router.add_post(PREFILL_PATH, prefill)
    app.on_startup.append(_open_session)
    app.on_cleanup.append(_close_session)


@contextmanager
def _admitted(cfg: HandoffConfig, role: str) -> Iterator[None]:
    live = cfg.role
    if not live.admits(role):
        now = f"{live.role}, draining" if live.draining else live.role
        raise unavailable(f"this node takes no {role} work now (it is {now})", 1)
    with live.serving(role):
        yield


def routed_work(request: web.Request) -> AbstractContextManager[None]:
    """A request a router sent (its header names one) is decode work: admitted while this
    node is a decode node and not draining (else a 503 the router retries elsewhere), counted
    while it runs. Other requests pass as they are."""
    cfg = request.app.get(HANDOFF)
    if cfg is None or ROUTER_HEADER not in request.headers:
        return nullcontext()
    return _admitted(cfg, "decode")


async def _open_session(app: web.Application) -> None:
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def _close_session(app: web.Application) -> None:
    await app[SESSION].close()


def stale_epoch(epoch: object, own: int) -> ApiError:
    return ApiError(
        409, f"stale epoch {epoch}: this node is at epoch {own}", param="epoch", code="stale_epoch"
    )


async def prefill(request: web.Request) -> web.StreamResponse:
    """{"request_id", "prompt_ids", "cache_salt" (hex), "traffic_class", "epoch", "prefix_hash",
    "lease_ms", "store" (optional: the decode node's block store, {"id", "fingerprint",
    "block_size"})} -> the KV state of positions [0, len - 1) in the wire format, less the
    leading full blocks published in that store when it is this node's too. 503 while this
    node is no prefill node (or drains its prefill role)."""
    with _admitted(request.app[HANDOFF], "prefill"):
        return await _prefill(request)


async def _prefill(request: web.Request) -> web.StreamResponse:
    state, cfg = get_state(request), request.app[HANDOFF]
    body = await read_json_object(request)
    start = time.time()
    handoff_id = body.get("request_id")
    if not isinstance(handoff_id, str) or not HANDOFF_ID.match(handoff_id):
        raise bad_request("'request_id' must be 1-128 letters, digits, '-' or '_'", "request_id")
    if body.get("epoch") != cfg.epoch or isinstance(body.get("epoch"), bool):
        raise stale_epoch(body.get("epoch"), cfg.epoch)
    prompt = body.get("prompt_ids")
    if not isinstance(prompt, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        raise bad_request("'prompt_ids' must be a list of token ids", "prompt_ids")
    salt = _salt(body.get("cache_salt", ""))
    traffic_class = body.get("traffic_class", "chat")
    classes = state.engine.traffic_classes
    if not isinstance(traffic_class, str) or (classes is not None and traffic_class not in classes):
        raise bad_request(f"unknown traffic_class {traffic_class!r}", "traffic_class")
    lease_ms = body.get("lease_ms")
    if (
        not isinstance(lease_ms, int)
        or isinstance(lease_ms, bool)
        or not 0 < lease_ms <= MAX_LEASE_MS
    ):
        raise bad_request(f"'lease_ms' must be an integer in (0, {MAX_LEASE_MS}]", "lease_ms")
    store = _store_offer(body.get("store"))
    end = len(prompt) - 1
    digest = prefix_hash(prompt, end, salt)
    if body.get("prefix_hash") != digest:
        raise bad_request("'prefix_hash' does not match the prompt", "prefix_hash")
    state.check_engine()
    rid = f"handoff-{handoff_id}"
    if rid in state.engine.requests:
        raise ApiError(409, f"handoff {handoff_id} is already running", param="request_id")
    try:
        got = await state.engine.prefill_export(prompt, rid, salt, traffic_class, store)
    except RequestRejected as e:
        raise bad_request(str(e), e.param) from None
    except HandoffFailed as e:
        raise unavailable(f"the prefill failed: {e}") from None
    except RuntimeError:  # the engine loop has failed
        raise unavailable("the inference engine has failed; the server must be restarted") from None
    deadline = start + lease_ms / 1000
    if time.time() > deadline:
        raise ApiError(504, "the handoff's lease ran out before the prefill was done", code="lease")
    meta = HandoffMeta(handoff_id, cfg.epoch, digest, deadline, cfg.fingerprint)
    response = web.StreamResponse(status=200, headers={"Content-Type": CONTENT_TYPE})
    sending = time.monotonic()
    await response.prepare(request)
    async for chunk in encode(got, meta):
        await response.write(chunk)
    await response.write_eof()
    state.engine.handoffs.sent(time.monotonic() - sending)
    log.info(
        "kv_handoff_sent",
        handoff_id=handoff_id,
        tokens=end,
        stored_blocks=len(got.stored),
        seconds=round(time.time() - start, 4),
    )
    return response


def _store_offer(raw: object) -> StoreOffer | None:
    if raw is None:
        return None
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("id"), str)
        or not 0 < len(raw["id"]) <= 128
        or not isinstance(raw.get("fingerprint"), str)
        or len(raw["fingerprint"]) > 128
        or not isinstance(raw.get("block_size"), int)
        or isinstance(raw["block_size"], bool)
        or raw["block_size"] <= 0
    ):
        raise bad_request(
            "'store' must be an object with 'id', 'fingerprint' (strings) and 'block_size' "
            "(a positive integer)",
            "store",
        )
    return StoreOffer(raw["id"], raw["fingerprint"], raw["block_size"])


def _salt(raw: object) -> bytes:
    if not isinstance(raw, str) or len(raw) > 2048:
        raise bad_request("'cache_salt' must be a hex string", "cache_salt")
    try:
        return bytes.fromhex(raw)
    except ValueError:
        raise bad_request("'cache_salt' must be a hex string", "cache_salt") from None


def kv_source_for(request: web.Request, jobs: int, cache: CacheOptions) -> KVSource | None:
    """A decode node's KVSource for a request the router sent (its headers name the router and
    the handoff); None for others, and for several jobs (n > 1: each computes its prompt)."""
    cfg = request.app.get(HANDOFF)
    if cfg is None or cfg.role.role != "decode" or jobs != 1:
        return None
    router = request.headers.get(ROUTER_HEADER, "").rstrip("/")
    handoff_id = request.headers.get(HANDOFF_HEADER, "")
    if not router or not HANDOFF_ID.match(handoff_id):
        return None
    if router not in cfg.routers:
        # a URL from a header is asked only when it is one of this node's own registries
        log.warning("kv_handoff_unknown_router", router=router[:200])
        return None
    return HttpKVSource(
        request.app[SESSION],
        router,
        handoff_id,
        cfg.fingerprint,
        cfg.timeout_s,
        cache_salt=cache.cache_salt,
        traffic_class=cache.traffic_class,
        api_key=cfg.api_key,
    )
