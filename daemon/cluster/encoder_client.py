"""A prefill node's image encoder on encoder nodes: `POST <encoder>/cluster/v1/encode` with the
preprocessed images, the embeddings back; each encoder in turn until one answers in time."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
import structlog
import torch

from daemon.cluster.image_wire import CONTENT_TYPE, ImagePayload, PayloadError, pack, unpack
from daemon.loop.images import EncoderFailed

log = structlog.get_logger(__name__)

ENCODE_PATH = "/cluster/v1/encode"
MAX_EMBEDDING_BYTES = 1 << 30


class HttpImageEncoder:
    """Encoder nodes `urls` (base URLs), tried in order from the one that last answered; each
    call has `timeout_s` in all per encoder. Embeddings must come from the same model
    (`fingerprint`) and have `image_tokens` x `hidden` rows per image."""

    def __init__(
        self,
        urls: Sequence[str],
        fingerprint: str,
        image_tokens: int,
        hidden: int,
        timeout_s: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        if not urls:
            raise ValueError("an HttpImageEncoder needs at least one encoder URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.fingerprint = fingerprint
        self.shape = (image_tokens, hidden)
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": CONTENT_TYPE}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None
        self._first = 0  # the encoder that answered last

    async def encode(self, pixel_values: torch.Tensor, digests: Sequence[bytes]) -> torch.Tensor:
        body = pack(ImagePayload(pixel_values.float(), list(digests), self.fingerprint))
        errors = []
        for i in range(len(self.urls)):
            k = (self._first + i) % len(self.urls)
            try:
                out = await asyncio.wait_for(self._post(self.urls[k], body), self.timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError, PayloadError, EncoderFailed) as e:
                reason = "timeout" if isinstance(e, TimeoutError) else str(e) or type(e).__name__
                log.warning("image_encoder_failed", encoder=self.urls[k], error=reason[:300])
                errors.append(f"{self.urls[k]}: {reason[:200]}")
                continue
            self._first = k
            if tuple(out.tensor.shape) != (len(digests), *self.shape):
                raise EncoderFailed(f"{self.urls[k]} sent embeddings of shape {out.tensor.shape}")
            return out.tensor.float()
        raise EncoderFailed("no encoder answered: " + "; ".join(errors))

    async def _post(self, url: str, body: bytes) -> ImagePayload:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._session.post(url + ENCODE_PATH, data=body, headers=self.headers) as r:
            if r.status != 200:
                raise EncoderFailed(f"answered {r.status}: {(await r.text())[:200]}")
            data = await r.read()
        out = unpack(data, MAX_EMBEDDING_BYTES)
        if out.fingerprint != self.fingerprint:
            raise EncoderFailed("the encoder serves another model")
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
