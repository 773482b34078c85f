"""Image embeddings for a vision-language model: encoded once per content hash (a host-memory
LRU within a byte budget, concurrent requests for one image share its encoding), by an encoder
on this node's device or on an encoder node."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from daemon.models.base import VisionLanguageModel


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, preprocessed by the model's processor."""

    digest: bytes  # sha256 of the image's bytes
    pixel_values: torch.Tensor  # [3, H, W]
    start: int  # prompt position of its first placeholder token


@dataclass(frozen=True)
class ImageSpan:
    """An image's embeddings, for the prompt positions [start, start + len(embeds))."""

    start: int
    embeds: torch.Tensor  # [image_tokens, hidden] on the host
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.embeds.shape[0]


class ImageEncoder(Protocol):
    """Turns preprocessed images into their embeddings; raises EncoderFailed when it cannot."""

    async def encode(self, pixel_values: torch.Tensor, digests: Sequence[bytes]) -> torch.Tensor:
        """[images, image_tokens, hidden] host embeddings of `pixel_values` [images, 3, H, W]
        (`digests`: each image's content hash, for an encoder with a cache of its own)."""
        ...

    async def close(self) -> None: ...


class EncoderFailed(Exception):
    """No embeddings: the encoder (a peer, usually) failed or timed out."""


class DeviceImageEncoder:
    """The model's vision tower on this node, on a thread of its own (the forward's thread
    stays with the language model's steps)."""

    def __init__(self, model: VisionLanguageModel, device: torch.device) -> None:
        self.model, self.device = model, device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vision")

    async def encode(self, pixel_values: torch.Tensor, digests: Sequence[bytes]) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._run, pixel_values)

    def _run(self, pixel_values: torch.Tensor) -> torch.Tensor:
        try:
            with torch.inference_mode():
                out = self.model.encode_images(pixel_values.to(self.device))
        except (RuntimeError, ValueError) as e:  # e.g. images of a size the tower does not take
            raise EncoderFailed(f"the vision tower failed: {e}") from None
        return out.float().cpu()

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class ImageStats:
    encoded: int = 0  # images the encoder encoded
    hits: int = 0  # images whose embeddings were cached (or being encoded already)

    def as_dict(self) -> dict[str, int]:
        return {"images_encoded": self.encoded, "image_cache_hits": self.hits}


@dataclass
class ImageEmbeddings:
    """Embeddings by sha256(model fingerprint | image digest), LRU within `budget_bytes`."""

    encoder: ImageEncoder
    fingerprint: bytes
    budget_bytes: int
    stats: ImageStats = field(default_factory=ImageStats)
    _cache: OrderedDict[bytes, torch.Tensor] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _pending: dict[bytes, asyncio.Future[torch.Tensor]] = field(default_factory=dict)
    _tasks: set[asyncio.Future[dict[bytes, torch.Tensor]]] = field(default_factory=set)

    def key(self, digest: bytes) -> bytes:
        return hashlib.sha256(self.fingerprint + digest).digest()

    async def spans(self, images: Sequence[ImageInput]) -> list[ImageSpan]:
        """The embeddings of `images`, each encoded at most once (raises EncoderFailed)."""
        keys = [self.key(im.digest) for im in images]
        found: dict[bytes, torch.Tensor] = {}
        waits: dict[bytes, asyncio.Future[torch.Tensor]] = {}
        todo: dict[bytes, ImageInput] = {}
        for k, im in zip(keys, images):
            if k in found or k in waits or k in todo:
                self.stats.hits += 1
            elif (hit := self._cache.get(k)) is not None:
                self._cache.move_to_end(k)
                found[k] = hit
                self.stats.hits += 1
            elif k in self._pending:
                waits[k] = self._pending[k]
                self.stats.hits += 1
            else:
                todo[k] = im
        if todo:
            # its own task: a client that goes away does not cancel what others may wait for
            task = asyncio.ensure_future(self._encode(todo))
            self._tasks.add(task)
            task.add_done_callback(_forget(self._tasks))
            found |= await asyncio.shield(task)
        for k, fut in waits.items():
            found[k] = await asyncio.shield(fut)
        return [ImageSpan(im.start, found[k], im.digest) for k, im in zip(keys, images)]

    async def _encode(self, todo: dict[bytes, ImageInput]) -> dict[bytes, torch.Tensor]:
        loop = asyncio.get_running_loop()
        futures = {k: loop.create_future() for k in todo}
        self._pending.update(futures)
        try:
            pixels = torch.stack([im.pixel_values for im in todo.values()])
            out = await self.encoder.encode(pixels, [im.digest for im in todo.values()])
        except BaseException as e:  # cancelled too (the engine stopping): nobody waits on
            failed = e if isinstance(e, EncoderFailed) else EncoderFailed(str(e) or repr(e))
            for fut in futures.values():
                fut.set_exception(failed)
                fut.exception()  # retrieved: nobody else may be waiting
            if not isinstance(e, Exception):
                raise
            raise failed from None
        finally:
            for k in futures:
                self._pending.pop(k, None)
        self.stats.encoded += len(todo)
        result = {}
        for k, embeds in zip(todo, out):
            embeds = embeds.contiguous()
            result[k] = embeds
            futures[k].set_result(embeds)
            self._put(k, embeds)
        return result

    def _put(self, key: bytes, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.budget_bytes:
            return
        self._cache[key] = embeds
        self._bytes += size
        while self._bytes > self.budget_bytes:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.encoder.close()


def _forget(tasks: set) -> Callable[[asyncio.Future], None]:
    """Drops a finished encoding from `tasks`, its exception retrieved (its caller may be
    gone)."""

    def done(task: asyncio.Future) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()

    return done
