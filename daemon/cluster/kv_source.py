"""The decode side's KVSource over HTTP: the router names a prefill node, the node computes the
prompt and streams its KV state (wire.py), checked here before the engine imports it. Offered
this node's block store, a prefill node sharing it leaves the full blocks published there out
of the stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import orjson

from daemon.cluster.wire import CONTENT_TYPE, MAX_PAYLOAD_BYTES, Expected, decode, prefix_hash
from daemon.loop.handoff import Fetched, HandoffFailed, StoreOffer

ROUTE_PATH = "/cluster/v1/route/prefill"
PREFILL_PATH = "/cluster/v1/prefill"
CONNECT_TIMEOUT_S = 5.0
ROUTE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PrefillNode:
    """The router's answer: which prefill node to ask, its epoch, and the handoff's lease."""

    node_id: str
    url: str
    epoch: int
    lease_ms: int


@dataclass
class HttpKVSource:
    """One request's handoff. `prefill`: a given node (else the router picks one);
    `timeout_s`: the whole fetch, route and payload (the cluster's --handoff-timeout-s)."""

    session: aiohttp.ClientSession
    router_url: str
    request_id: str  # the handoff's id, as the prefill node and the payload carry it
    fingerprint: str
    timeout_s: float
    cache_salt: bytes = b""
    traffic_class: str = "chat"
    api_key: str | None = field(default=None, repr=False)
    prefill: PrefillNode | None = None
    max_bytes: int = MAX_PAYLOAD_BYTES

    async def fetch(
        self,
        prompt_ids: list[int],
        block_keys: list[bytes],
        end: int,
        store: StoreOffer | None = None,
    ) -> Fetched:
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.prefill is None:  # a second fetch asks the same node again
                    self.prefill = await self._route(prompt_ids, block_keys)
                return await self._prefill(self.prefill, prompt_ids, end, block_keys, store)
        except aiohttp.ClientError as e:  # payload / protocol errors: counted as connection
            if isinstance(e, OSError):
                raise
            raise ConnectionError(f"{type(e).__name__}: {e}") from None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _route(self, prompt_ids: list[int], block_keys: list[bytes]) -> PrefillNode:
        body = {
            "model_fingerprint": self.fingerprint,
            "block_keys": [k.hex() for k in block_keys],
            "num_tokens": len(prompt_ids),
        }
        timeout = aiohttp.ClientTimeout(total=ROUTE_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
        async with self.session.post(
            self.router_url + ROUTE_PATH,
            data=orjson.dumps(body),
            headers=self._headers() | {"Content-Type": "application/json"},
            timeout=timeout,
        ) as resp:
            if resp.status != 200:
                raise HandoffFailed(f"the router found no prefill node ({resp.status})")
            answer = orjson.loads(await resp.read())
        try:
            node = PrefillNode(
                answer["node_id"], answer["url"], answer["epoch"], answer["lease_ms"]
            )
        except (KeyError, TypeError):
            raise HandoffFailed("the router's prefill route is malformed") from None
        if not isinstance(node.epoch, int) or not isinstance(node.lease_ms, int):
            raise HandoffFailed("the router's prefill route is malformed")
        return node

    async def _prefill(
        self,
        node: PrefillNode,
        prompt_ids: list[int],
        end: int,
        block_keys: list[bytes],
        store: StoreOffer | None,
    ) -> Fetched:
        expected_hash = prefix_hash(prompt_ids, end, self.cache_salt)
        body: dict[str, object] = {
            "request_id": self.request_id,
            "prompt_ids": prompt_ids,
            "cache_salt": self.cache_salt.hex(),
            "traffic_class": self.traffic_class,
            "epoch": node.epoch,
            "prefix_hash": expected_hash,
            "lease_ms": node.lease_ms,
        }
        if store is not None:
            body["store"] = {
                "id": store.identity,
                "fingerprint": store.fingerprint,
                "block_size": store.block_size,
            }
        # the total is the fetch's own (the caller's asyncio.timeout)
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S)
        async with self.session.post(
            node.url + PREFILL_PATH,
            data=orjson.dumps(body),
            headers=self._headers() | {"Content-Type": "application/json"},
            timeout=timeout,
        ) as resp:
            if resp.status == 409:
                raise HandoffFailed(f"prefill node {node.node_id}: stale epoch {node.epoch}")
            if resp.status != 200 or resp.content_type != CONTENT_TYPE:
                raise HandoffFailed(f"prefill node {node.node_id} answered {resp.status}")
            expect = Expected(
                self.request_id,
                node.epoch,
                expected_hash,
                self.fingerprint,
                end,
                self.max_bytes,
                store_keys=block_keys[: end // store.block_size] if store is not None else [],
                block_size=store.block_size if store is not None else 0,
            )
            return await decode(resp.content, expect)
