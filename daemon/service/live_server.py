"""The API server in-process for the tests and the benchmarks: create_app + start_server (the
daemon's own code) on 127.0.0.1, on its own thread and uvloop loop so callers may use any loop."""

from __future__ import annotations

import asyncio
import socket
import threading

import uvloop

from daemon.api.http.config import ServerConfig
from daemon.api.http.server import bound_port, create_app, start_server
from daemon.build.config import EngineConfig
from daemon.build.demo import model_path
from daemon.build.engine import build_engine
from daemon.loop.metrics import EngineMetrics
from daemon.service.logs import add_secret


def free_port() -> int:
    """A port nothing listens on now, for a server that must be told its port beforehand."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """create_app + start_server (the daemon's own code) on 127.0.0.1:<free port>."""

    def __init__(self, engine_cfg: EngineConfig, server_cfg: ServerConfig) -> None:
        self.engine_cfg, self.server_cfg = engine_cfg, server_cfg
        self.port = 0
        self.model = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="api-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(180):
            raise RuntimeError("the test server did not start within 180 s")
        if self._error is not None:
            raise RuntimeError("the test server failed to start") from self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _main(self) -> None:
        self._loop = uvloop.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        metrics = EngineMetrics()
        engine, self.model = build_engine(self.engine_cfg, metrics)
        add_secret(self.server_cfg.api_key)
        runner = await start_server(
            create_app(
                engine,
                self.model,
                self.server_cfg,
                metrics=metrics,
                model_dir=model_path(self.engine_cfg),
            ),
            self.server_cfg,
        )
        self.port = bound_port(runner)
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
