"""The admin socket: a Unix-domain socket (mode 0600, so only the daemon's user and root can
connect) served by aiohttp, for live operations: status, expert load, rebalance now, set the
MoE intervals, drain and resume, a prefill / decode node's role change. `deepinfer admin ...`
is its client."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import orjson
from aiohttp import web

from daemon.api.codecs.params import get_int
from daemon.api.http.admin_http import change_role
from daemon.api.http.errors import ApiError, bad_request, error_middleware
from daemon.api.http.state import ApiState
from daemon.build.startup import StartupError, failing_as
from daemon.cluster.live_role import RoleChanger

routes = web.RouteTableDef()
ADMIN: web.AppKey[ApiState] = web.AppKey("deepinfer_admin", ApiState)
ROLE_CHANGE: web.AppKey[RoleChanger | None] = web.AppKey("deepinfer_admin_role_change")
PROBE_TIMEOUT_S = 1.0  # how long a socket left at the admin path gets to answer


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _moe(request: web.Request):
    moe = request.app[ADMIN].engine.moe
    if moe is None:
        raise ApiError(409, "this model has no MoE layers", code="not_moe")
    return moe


@routes.get("/status")
async def status(request: web.Request) -> web.Response:
    state = request.app[ADMIN]
    engine = state.engine
    body = {
        "model": state.served_name,
        "draining": state.draining,
        "engine_failed": engine.error is not None,
    } | engine.stats()
    if engine.moe is not None:
        body["moe"] = engine.moe.status()
    return _json(body)


@routes.get("/expert-load")
async def expert_load(request: web.Request) -> web.Response:
    return _json(_moe(request).expert_load())


@routes.post("/rebalance")
async def rebalance(request: web.Request) -> web.Response:
    moe = _moe(request)
    if moe.ep is None or moe.ep.size == 1:
        raise ApiError(
            409, "nothing to rebalance: the experts are not spread over ranks", code="no_ep"
        )
    moe.request_rebalance()
    return _json({"ok": True, "requested": True, "placement_version": moe.version})


@routes.post("/intervals")
async def intervals(request: web.Request) -> web.Response:
    moe = _moe(request)
    body = await _body(request)
    unknown = set(body) - {"stats_interval", "rebalance_interval"}
    if unknown:
        raise bad_request(
            f"unknown fields {sorted(unknown)}; use stats_interval, rebalance_interval"
        )
    stats = get_int(body, "stats_interval", lo=1)
    every = get_int(body, "rebalance_interval", lo=0)
    if stats is None and every is None:
        raise bad_request("give stats_interval and/or rebalance_interval")
    if moe.ep is not None and moe.ep.rank != 0:
        raise ApiError(
            409, "set the intervals on rank 0: it schedules the whole group", code="not_rank0"
        )
    moe.set_intervals(stats, every)
    return _json(
        {
            "ok": True,
            "stats_interval": moe.stats_interval,
            "rebalance_interval": moe.rebalance_interval,
        }
    )


@routes.post("/drain")
async def drain(request: web.Request) -> web.Response:
    state = request.app[ADMIN]
    state.draining = True
    return _json({"ok": True, "draining": True, "requests": len(state.engine.requests)})


@routes.post("/resume")
async def resume(request: web.Request) -> web.Response:
    request.app[ADMIN].draining = False
    return _json({"ok": True, "draining": False})


@routes.post("/role")
async def set_role(request: web.Request) -> web.Response:
    """{"role": "prefill" | "decode"}: drain the current role, switch, register again."""
    return _json(await change_role(request.app[ROLE_CHANGE], await _body(request)))


async def _body(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def create_admin_app(state: ApiState, role_change: RoleChanger | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024)
    app[ADMIN] = state
    app[ROLE_CHANGE] = role_change
    app.router.add_routes(routes)
    return app


def bind_admin(path: str) -> socket.socket:
    """The admin socket bound at `path` (mode 0600), not yet listening. StartupError when the
    path cannot hold a socket, or holds anything but a stale socket (one nobody listens on)."""
    with failing_as(f"cannot create the admin socket {path}", OSError):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # no window in which others could connect
        try:
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
    return sock


def _remove_stale(path: str) -> None:
    """Removes a socket left behind by a daemon that died; StartupError for anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"cannot create the admin socket {path}: it exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        # a listener that does not accept (a stopped daemon, its backlog full) is in use too;
        # a blocking connect would wait on it for as long as it stays stopped
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: stale
        except (BlockingIOError, TimeoutError):
            raise StartupError(
                f"cannot create the admin socket {path}: another process is listening on it"
            ) from None
        else:
            raise StartupError(
                f"cannot create the admin socket {path}: another process is listening on it"
            )
    os.unlink(path)


async def start_admin(
    state: ApiState, sock: socket.socket, role_change: RoleChanger | None = None
) -> web.AppRunner:
    """Serve the admin app on `sock` (from `bind_admin`)."""
    runner = web.AppRunner(create_admin_app(state, role_change), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner
