"""A node's image encoder on encoder nodes: `POST <encoder>/cluster/v1/encode` with the images
as sent (encoded bytes: only the encoder node decodes and preprocesses them), the embeddings
back; each encoder in turn until one answers in time (an image it finds undecodable is the
request's fault: no other is asked). The encoders: those the settings name, then those
registered with this node's registries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp
import orjson
import structlog
import torch

from daemon.cluster.image_wire import (
    ENCODED_CONTENT_TYPE,
    EncodedImages,
    ImagePayload,
    PayloadError,
    pack_encoded,
    unpack,
)
from daemon.cluster.registry_routes import NODES
from daemon.loop.image_input import ImageInput, ImageRejected
from daemon.loop.images import EncoderFailed, ImageEncoder

log = structlog.get_logger(__name__)

ENCODE_PATH = "/cluster/v1/encode"
MAX_EMBEDDING_BYTES = 1 << 30
LIST_TIMEOUT_S = 2.0


class HttpImageEncoder:
    """Encoder nodes: `urls` (base URLs), then the encoders registered with `registries`
    (looked up at most every `refresh_s`), the one that answered last first; each has
    `timeout_s` in all. With none known, `fallback` (this node's own tower) encodes.
    Embeddings must come from the same model (`fingerprint`), `image_tokens` x `hidden` per
    image."""

    def __init__(
        self,
        urls: Sequence[str],
        fingerprint: str,
        image_tokens: int,
        hidden: int,
        timeout_s: float = 10.0,
        api_key: str | None = None,
        registries: Sequence[str] = (),
        fallback: ImageEncoder | None = None,
        refresh_s: float = 5.0,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.registries = [u.rstrip("/") for u in registries]
        self.fingerprint = fingerprint
        self.shape = (image_tokens, hidden)
        self.timeout_s = timeout_s
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.fallback = fallback
        self.refresh_s = refresh_s
        self._session: aiohttp.ClientSession | None = None
        self._last: str | None = None  # the encoder that answered last
        self._registered: list[str] = []
        self._refresh_at = 0.0

    async def encode(self, images: Sequence[ImageInput]) -> torch.Tensor:
        urls = await self._candidates()
        if not urls:
            if self.fallback is None:
                raise EncoderFailed("no encoder node is known")
            return await self.fallback.encode(images)
        if not all(im.data for im in images):
            raise EncoderFailed("an image has no bytes to send to an encoder node")
        digests = [im.digest for im in images]
        sent = EncodedImages([im.data for im in images], digests, self.fingerprint)
        body = pack_encoded(sent)
        errors = []
        for url in urls:
            try:
                out = await asyncio.wait_for(self._post(url, body, images), self.timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError, PayloadError, EncoderFailed) as e:
                reason = "timeout" if isinstance(e, TimeoutError) else str(e) or type(e).__name__
                log.warning("image_encoder_failed", encoder=url, error=reason[:300])
                errors.append(f"{url}: {reason[:200]}")
                continue
            self._last = url
            if tuple(out.tensor.shape) != (len(digests), *self.shape):
                raise EncoderFailed(f"{url} sent embeddings of shape {tuple(out.tensor.shape)}")
            return out.tensor.float()
        raise EncoderFailed("no encoder answered: " + "; ".join(errors))

    async def _candidates(self) -> list[str]:
        urls = list(dict.fromkeys(self.urls + await self._from_registries()))
        if self._last in urls:
            urls.remove(self._last)
            urls.insert(0, self._last)
        return urls

    async def _from_registries(self) -> list[str]:
        if not self.registries or time.monotonic() < self._refresh_at:
            return self._registered
        found: list[str] = []
        for registry in self.registries:
            try:
                nodes = await asyncio.wait_for(self._list(registry), LIST_TIMEOUT_S)
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
                log.warning("image_encoder_list_failed", registry=registry, error=repr(e)[:200])
                continue
            found.extend(n for n in nodes if n not in found)
        self._registered, self._refresh_at = found, time.monotonic() + self.refresh_s
        return found

    async def _list(self, registry: str) -> list[str]:
        async with self._client().get(
            registry + NODES, params={"role": "encoder"}, headers=self.auth
        ) as r:
            if r.status != 200:
                raise ValueError(f"the registry answered {r.status}")
            data = (await r.json()).get("data")
        if not isinstance(data, list):
            raise ValueError("the registry's list has no data")
        return [n["url"] for n in data if isinstance(n, dict) and isinstance(n.get("url"), str)]

    async def _post(self, url: str, body: bytes, images: Sequence[ImageInput]) -> ImagePayload:
        headers = {"Content-Type": ENCODED_CONTENT_TYPE} | self.auth
        async with self._client().post(url + ENCODE_PATH, data=body, headers=headers) as r:
            if r.status == 400:
                _rejected(await r.read(), images)
            if r.status != 200:
                raise EncoderFailed(f"answered {r.status}: {(await r.text())[:200]}")
            data = await r.read()
        out = unpack(data, MAX_EMBEDDING_BYTES)
        if out.fingerprint != self.fingerprint:
            raise EncoderFailed("the encoder serves another model")
        return out

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.fallback is not None:
            await self.fallback.close()


def _rejected(body: bytes, images: Sequence[ImageInput]) -> None:
    """An encoder's 400 naming one of `images` (`images[i]`, a header or a pixel it could not
    decode) as ImageRejected naming where the request has it; other 400s: EncoderFailed."""
    try:
        error = orjson.loads(body)["error"]
        message, param = str(error["message"]), str(error["param"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise EncoderFailed(f"answered 400: {body[:200]!r}") from None
    if param.startswith("images[") and param.endswith("]"):
        i = param[len("images[") : -1]
        if i.isdigit() and int(i) < len(images):
            raise ImageRejected(message, images[int(i)].param)
    raise EncoderFailed(f"answered 400: {message[:200]}")
