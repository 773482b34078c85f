"""HTTP discovery, the node's side: registers with every registry URL (`--peers`), heartbeats
every lease/3 with its load, registers again when a heartbeat finds itself unknown (the
registry restarted or the lease lapsed) and leaves on drain; a live role change registers again
at once. Every call has a timeout: a dead registry costs a log line, never the node."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import replace

import aiohttp
import structlog

from daemon.cluster.announce import Load
from daemon.cluster.node import NodeInfo, Role
from daemon.cluster.registry_routes import NODES

log = structlog.get_logger(__name__)

LEAVE_TIMEOUT_S = 2.0
_FAILURES = (aiohttp.ClientError, TimeoutError, OSError, ValueError)


class HttpRegistrar:
    def __init__(
        self,
        info: NodeInfo,
        registries: list[str],
        lease_s: float,
        load: Load,
        api_key: str | None = None,
    ) -> None:
        self.info, self.registries, self.lease_s, self.load = info, registries, lease_s, load
        self.interval = lease_s / 3
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.registered: dict[str, bool] = dict.fromkeys(registries, False)
        self._left = False

    async def start(self) -> None:
        # each call is bounded by a heartbeat interval: a late one is as good as lost
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.interval), headers=self._headers
        )
        self._start_keeping()

    def _start_keeping(self) -> None:
        if self._left:  # a role change that ends after the node left registers nowhere
            return
        self._tasks = [
            asyncio.create_task(self._keep(url.rstrip("/")), name=f"registrar {url}")
            for url in self.registries
        ]

    async def _stop_keeping(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def refresh(self) -> None:
        """A heartbeat to every registry now (the load changed in a way routers must see)."""
        if self._session is None:
            return
        await asyncio.gather(
            *(self._now(url.rstrip("/"), self._heartbeat) for url in self.registries)
        )

    async def set_role(self, role: Role) -> None:
        """Registers again with `role`, now; the heartbeats stop meanwhile, so that no
        registration of the old role can land after the new one."""
        self.info = replace(self.info, role=role)
        if self._session is None or self._left:
            return
        await self._stop_keeping()
        urls = [url.rstrip("/") for url in self.registries]
        done = await asyncio.gather(*(self._now(url, self._register) for url in urls))
        for url, ok in zip(self.registries, done, strict=True):
            self.registered[url] = bool(ok)
        self._start_keeping()

    async def _now(self, url: str, call: Callable[[str], Awaitable[bool]]) -> bool:
        try:
            return await call(url)
        except _FAILURES as e:  # the heartbeat loop tries again
            log.warning("registry_unreachable", registry=url, error=repr(e))
            return False

    async def leave(self) -> None:
        self._left = True
        await self._stop_keeping()
        if self._session is None:
            return
        try:
            await asyncio.gather(*(self._leave(url.rstrip("/")) for url in self.registries))
        finally:
            await self._session.close()

    async def _keep(self, url: str) -> None:
        loop = asyncio.get_running_loop()
        reachable = True
        while True:
            started = loop.time()
            try:
                if not self.registered[url] or not await self._heartbeat(url):
                    self.registered[url] = await self._register(url)
                if not reachable:
                    log.info("registry_reachable", registry=url)
                reachable = True
            except _FAILURES as e:
                self.registered[url] = self.registered[url] and isinstance(e, TimeoutError)
                if reachable:  # once per outage, not once per heartbeat
                    log.warning("registry_unreachable", registry=url, error=repr(e))
                reachable = False
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def _register(self, url: str) -> bool:
        body = replace(self.info, load=self.load()).to_json() | {"ttl_s": self.lease_s}
        assert self._session is not None
        async with self._session.post(url + NODES, json=body) as resp:
            if resp.status == 200:
                log.info("registered", registry=url, node_id=self.info.node_id, role=self.info.role)
                return True
            log.warning(
                "registration_refused", registry=url, status=resp.status, error=await _text(resp)
            )
            return False

    async def _heartbeat(self, url: str) -> bool:
        """False: the registry does not know this node (any more): register again."""
        body = {"epoch": self.info.epoch, "load": self.load()}
        assert self._session is not None
        async with self._session.put(f"{url}{NODES}/{self.info.node_id}", json=body) as resp:
            if resp.status == 200:
                return True
            if resp.status == 404:
                log.info("registry_forgot_node", registry=url, node_id=self.info.node_id)
            else:
                log.warning(
                    "heartbeat_refused", registry=url, status=resp.status, error=await _text(resp)
                )
            return False

    async def _leave(self, url: str) -> None:
        assert self._session is not None
        target = f"{url}{NODES}/{self.info.node_id}"
        try:
            async with self._session.delete(
                target,
                params={"epoch": str(self.info.epoch)},
                timeout=aiohttp.ClientTimeout(total=min(self.interval, LEAVE_TIMEOUT_S)),
            ) as resp:
                log.info("left_registry", registry=url, status=resp.status)
        except _FAILURES as e:  # its lease lapses there instead
            log.warning("leave_failed", registry=url, error=repr(e))


async def _text(resp: aiohttp.ClientResponse) -> str:
    return (await resp.text(errors="replace"))[:500]
