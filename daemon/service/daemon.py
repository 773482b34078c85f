"""The daemon's life: bind, build the engine, serve until a signal, drain, exit; SIGHUP
reloads what can change live."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import uvloop

from daemon.api.http.admin import bind_admin, start_admin
from daemon.api.http.cluster_autoscale import RouterAutoscaler
from daemon.api.http.cluster_handoff import HandoffConfig
from daemon.api.http.cluster_router import create_router_app
from daemon.api.http.cluster_state import RouterState
from daemon.api.http.server import bind_tcp, bound_port, create_app, start_server
from daemon.api.http.state import STATE, ApiState
from daemon.build.demo import is_demo, model_path
from daemon.build.engine import build_engine
from daemon.build.paths import gguf_cache
from daemon.cluster.announce import Announcer, Load
from daemon.cluster.autoscale import Autoscaler
from daemon.cluster.config import advertise_url, autoscale_targets, prefill_balance
from daemon.cluster.discovery import announcer, peer_feed, registers
from daemon.cluster.live_role import RoleChanger
from daemon.cluster.peers import PeerSet
from daemon.cluster.registry_routes import add_registry_routes
from daemon.cluster.router import Router
from daemon.cluster.slo_window import SloWindow
from daemon.loop.engine import Engine
from daemon.loop.metrics import EngineMetrics
from daemon.models.loader import read_config
from daemon.service import logs
from daemon.service.cluster_node import engine_load, fingerprint_of, local_node
from daemon.service.encoder_node import remote_encoder
from daemon.service.handoff_node import handoff_config
from daemon.service.heap import freeze_startup_heap
from daemon.service.sd_notify import Notifier
from daemon.service.settings import ConfigError, Settings

log = structlog.get_logger(__name__)

EXIT_ENGINE_FAILED = 4  # the engine loop failed while serving (3: it could not start)


async def serve(settings: Settings, reload: Callable[[], Settings] | None = None) -> int:
    """Builds the engine and serves until SIGTERM/SIGINT; then drains (new requests get 503,
    running ones finish within `shutdown_timeout`; a second signal aborts them) and exits.
    SIGHUP re-reads the settings (`reload`) and applies what can change live."""
    if settings.cluster.role == "router":
        return await serve_router(settings)
    engine_cfg, server_cfg = settings.engine, settings.server
    # Both sockets are bound before the model loads (minutes, for a big one), so that a taken
    # port or an unusable socket path stops the start at once. A SIGTERM meanwhile stops the
    # start, closing them (and removing the admin socket's file) on the way out.
    previous = signal.signal(signal.SIGTERM, _stop_starting)
    engine = None
    try:
        with contextlib.ExitStack() as unused:
            socks = [unused.enter_context(s) for s in bind_tcp(server_cfg.host, server_cfg.port)]
            admin_sock = None
            if server_cfg.admin_socket:
                admin_sock = unused.enter_context(bind_admin(server_cfg.admin_socket))
                unused.callback(Path(server_cfg.admin_socket).unlink, missing_ok=True)
            metrics = EngineMetrics()
            engine, name = build_engine(
                engine_cfg,
                metrics,
                handoff_timeout_s=settings.cluster.handoff_timeout_s,
                handoff_min_tokens=settings.cluster.handoff_min_tokens,
                handoff_store=settings.cluster.handoff_store,
                handoff_store_wait_s=settings.cluster.handoff_store_wait_s,
                remote_images=remote_encoder(settings.cluster, server_cfg.api_key),
            )
            # restored first: past pop_all no _StopStarting could reach the `except` below
            # with the sockets already out of the stack
            signal.signal(signal.SIGTERM, previous)
            unused.pop_all()  # the sites own them from here
    except _StopStarting:
        signal.signal(signal.SIGTERM, previous)
        if engine is not None:  # built, not started: its I/O threads
            await engine.stop()
        log.info("stopped", during="startup")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    model_dir = model_path(engine_cfg)  # built: the demo's checkpoint exists
    kept = gguf_cache(engine_cfg)
    demo = is_demo(read_config(model_dir, kept))
    logs.add_secret(server_cfg.api_key)
    logs.add_secret(server_cfg.admin_token)
    cluster = settings.cluster
    in_a_cluster = registers(cluster) or cluster.role in ("prefill", "decode")
    fingerprint = await fingerprint_of(engine, model_dir, kept) if in_a_cluster else ""
    handoff = handoff_config(cluster, fingerprint, server_cfg.api_key)
    port = socks[0].getsockname()[1]  # the one bound (the settings may say 0)
    announce: Announcer | None = None
    node = None
    if registers(cluster):
        node = local_node(
            cluster, engine, name, fingerprint, server_cfg.host, port, engine_cfg.max_num_seqs
        )
        announce = announcer(cluster, node, _load(engine, handoff), server_cfg.api_key)
    role_change = (
        RoleChanger(handoff.role, announce, cluster.role_drain_timeout_s)
        if handoff is not None
        else None
    )
    app = create_app(
        engine,
        name,
        server_cfg,
        metrics=metrics,
        demo=demo,
        model_dir=model_dir,
        handoff=handoff,
        role_change=role_change,
        image_encoder=settings.cluster.role == "encoder",
    )
    add_registry_routes(app, PeerSet())  # any node can be a seed peer others register with
    runner = await start_server(app, server_cfg, socks)
    host = f"[{server_cfg.host}]" if ":" in server_cfg.host else server_cfg.host  # IPv6
    url = f"http://{host}:{bound_port(runner)}/v1"
    if announce is not None and node is not None:
        await announce.start()
        log.info(
            "cluster_node",
            node_id=node.node_id,
            role=node.role,
            advertise_url=node.url,
            fingerprint=node.fingerprint[:16],
            discovery=cluster.discovery,
            peers=cluster.peers,
        )
    admin = (
        await start_admin(app[STATE], admin_sock, role_change) if admin_sock is not None else None
    )
    notifier = Notifier()
    signals = _Signals(asyncio.get_running_loop(), lambda: _reload(app[STATE], reload))
    freeze_startup_heap()
    log.info(
        "serving",
        url=url,
        model=name,
        random_weight_demo=demo,
        systemd=notifier.enabled,
        admin_socket=server_cfg.admin_socket,
    )
    notifier.ready(f"serving {name} at {url}")
    notifier.start_watchdog()
    if app[STATE].codecs.constraints is not None:  # ready first, the grammar compiler after
        app[STATE].codecs.constraints.warm()
    status = asyncio.create_task(_report_status(engine, notifier), name="sd-status")
    try:
        await _first_of(signals.stop, engine.failed)
        if announce is not None:  # no new requests are routed here from now on
            await announce.leave()
            announce = None
        if engine.failed.is_set():
            # its requests were answered with an error; a fresh process (systemd restarts it,
            # Restart=on-failure) serves again, where this one could only answer 503
            log.error("engine_failed_exiting", error=repr(engine.error))
            notifier.stopping("the inference engine failed")
        else:
            app[STATE].draining = True
            notifier.stopping(f"draining {len(engine.requests)} requests")
            log.info("draining", requests=len(engine.requests), grace_s=server_cfg.shutdown_timeout)
            if not await _drain(engine, server_cfg.shutdown_timeout, signals.force):
                log.warning("drain_cut_short", aborted=len(engine.requests))
                for request_id in list(engine.requests):
                    engine.abort(request_id)
    finally:
        status.cancel()
        signals.remove()
        if announce is not None:
            await announce.leave()
        if admin is not None:
            await admin.cleanup()
            Path(server_cfg.admin_socket).unlink(missing_ok=True)
        await runner.cleanup()  # stops the engine, which flushes block-store writes
        await notifier.close()
    log.info("stopped")
    return EXIT_ENGINE_FAILED if engine.failed.is_set() else 0


async def serve_router(settings: Settings) -> int:
    """`--role router`: no model; the APIs by proxy to the registered nodes, until a signal
    (then the running answers get `shutdown_timeout` to finish)."""
    server_cfg, cluster = settings.server, settings.cluster
    socks = bind_tcp(server_cfg.host, server_cfg.port)
    port = socks[0].getsockname()[1]  # the one bound (the settings may say 0)
    logs.add_secret(server_cfg.api_key)
    logs.add_secret(server_cfg.admin_token)
    peers = PeerSet()
    state = RouterState(
        Router(peers, balance=prefill_balance(cluster)),
        url=advertise_url(cluster, server_cfg.host, port),
        lease_ms=int(cluster.handoff_timeout_s * 1000),
        created=int(time.time()),
        api_key=server_cfg.api_key,
        lost_grace_s=cluster.lost_node_grace_s,
        slo=SloWindow(cluster.autoscale_window_s),
    )
    app = create_router_app(
        state, server_cfg.max_body_bytes, lambda app: add_registry_routes(app, peers)
    )
    runner = await start_server(app, server_cfg, socks)
    feed = peer_feed(cluster, peers)  # etcd's nodes; over HTTP they register on the app
    if feed is not None:
        await feed.start()
    scaling = None
    if cluster.autoscale and server_cfg.admin_token:  # the settings' check asks for both
        scaler = RouterAutoscaler(
            state,
            Autoscaler(autoscale_targets(cluster)),
            cluster.autoscale_window_s,
            server_cfg.admin_token,
            cluster.role_drain_timeout_s,
        )
        scaling = asyncio.create_task(scaler.run(), name="autoscaler")
    notifier = Notifier()
    signals = _Signals(asyncio.get_running_loop(), _reopen_logs)
    log.info(
        "serving",
        role="router",
        url=state.url,
        systemd=notifier.enabled,
        autoscale=cluster.autoscale,
    )
    notifier.ready(f"routing at {state.url}")
    notifier.start_watchdog()
    try:
        await signals.stop.wait()
        notifier.stopping("router stopping")
    finally:
        if scaling is not None:
            scaling.cancel()
            await asyncio.gather(scaling, return_exceptions=True)
        signals.remove()
        if feed is not None:
            await feed.stop()
        await runner.cleanup()
        await notifier.close()
    log.info("stopped")
    return 0


def _load(engine: Engine, handoff: HandoffConfig | None) -> Load:
    """The engine's load for heartbeats, and whether a role change drains this node."""
    if handoff is None:
        return lambda: engine_load(engine)
    live = handoff.role
    return lambda: engine_load(engine) | live.load()


class _StopStarting(BaseException):
    """SIGTERM while the daemon starts (a BaseException: no `except Exception` swallows it)."""


def _stop_starting(_signum: int, _frame: object) -> None:
    raise _StopStarting


class _Signals:
    """SIGTERM/SIGINT: first one starts the drain, a second one cuts it short.
    SIGHUP: `on_hangup` (reload settings, reopen the log file after logrotate)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_hangup: Callable[[], None]) -> None:
        self.loop, self.stop, self.force = loop, asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_stop)
        loop.add_signal_handler(signal.SIGHUP, on_hangup)

    def _on_stop(self) -> None:
        if self.stop.is_set():
            self.force.set()
        self.stop.set()

    def remove(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self.loop.remove_signal_handler(sig)


def _reload(state: ApiState, reload: Callable[[], Settings] | None) -> None:
    """Live: logging (level, format, file, reopened), the API key, the waiting-queue limit and
    the MoE intervals. The rest needs a restart; a settings file that fails its checks changes
    nothing."""
    if reload is None:
        _reopen_logs()
        return
    try:
        new = reload()
        logs.setup_logging(new.logging.level, new.logging.format, new.logging.file)
    except ConfigError as e:
        log.warning("settings_reload_rejected", error=str(e))
        return
    except OSError as e:  # the logging stays as it was, and so does the rest
        log.warning(
            "settings_reload_rejected", error=f"cannot open the log file {e.filename}: {e.strerror}"
        )
        return
    logs.add_secret(new.server.api_key)
    state.api_key, state.max_waiting = new.server.api_key, new.server.max_waiting
    if state.engine.moe is not None:
        state.engine.moe.set_intervals(
            new.engine.moe_stats_interval, new.engine.moe_rebalance_interval
        )
    log.info(
        "settings_reloaded",
        log_level=new.logging.level,
        api_key_set=new.server.api_key is not None,
        max_waiting=new.server.max_waiting,
    )


def _reopen_logs() -> None:
    try:
        logs.SINK.reopen()
    except OSError as e:  # logs go on to the file as it was open
        log.warning("logs_reopen_failed", file=e.filename, error=e.strerror)
        return
    log.info("logs_reopened", file=logs.SINK.path)


async def _first_of(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def _drain(engine: Engine, timeout_s: float, force: asyncio.Event) -> bool:
    """True once no request is left, False when the timeout or `force` comes first."""
    deadline = time.monotonic() + timeout_s
    while engine.requests:
        if force.is_set() or time.monotonic() >= deadline:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(force.wait(), 0.05)
    return True


async def _report_status(engine: Engine, notifier: Notifier) -> None:
    if not notifier.enabled:
        return
    while True:
        await asyncio.sleep(5)
        stats = engine.stats()
        notifier.status(f"{stats['running']} running, {stats['waiting']} waiting")


def run_server(settings: Settings, reload: Callable[[], Settings] | None = None) -> int:
    return uvloop.run(serve(settings, reload))
