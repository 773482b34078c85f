"""Image embeddings for a vision-language model: encoded once per content hash (a host-memory
LRU within a byte budget, then the block store shared by the nodes; concurrent requests for one
image share its encoding), by an encoder on this node's device or on an encoder node."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from daemon.kv.block_store import BlockStore
from daemon.loop.image_input import ImageInput, ImageRejected
from daemon.models.base import VisionLanguageModel

STORE_KEY_BYTES = 16  # a block store key's size (the embeddings' key, cut)


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
    """Turns images into their embeddings; raises EncoderFailed when it cannot, ImageRejected
    for an image that cannot be decoded."""

    async def encode(self, images: Sequence[ImageInput]) -> torch.Tensor:
        """[images, image_tokens, hidden] host embeddings of `images` (their pixels made here;
        an encoder node is sent their bytes and digests, and has a cache of its own)."""
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

    async def encode(self, images: Sequence[ImageInput]) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        # the pixel work on a worker thread, not the vision thread: there it ran ~10x slower
        # under a CPU quota (bench/encoder.py --node-cpus 0.5; cause not pinned down)
        pixel_values = await asyncio.to_thread(_pixels, list(images))
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


def _pixels(images: list[ImageInput]) -> torch.Tensor:
    """[images, 3, H, W]: each image's pixels made (raises ImageRejected)."""
    pixels = []
    for im in images:
        if im.pixels is None:
            raise EncoderFailed("an image has no pixels to encode on this node")
        pixels.append(im.pixels())
    return torch.stack(pixels)


@dataclass
class ImageStats:
    encoded: int = 0  # images the encoder encoded
    hits: int = 0  # images whose embeddings were cached (or being encoded already)
    store_hits: int = 0  # host misses read from the block store instead of encoded

    def as_dict(self) -> dict[str, int]:
        return {
            "images_encoded": self.encoded,
            "image_cache_hits": self.hits,
            "image_store_hits": self.store_hits,
        }


@dataclass(frozen=True)
class EmbeddingStore:
    """Embeddings as files of the block store (a BlockStore of their own fingerprint and size:
    one image's [image_tokens, hidden] float32), read on a host miss before encoding, written
    after; a restarted node, or another node of the same model, finds them there."""

    store: BlockStore
    shape: tuple[int, int]  # [image_tokens, hidden]
    traffic_class: str = "chat"

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4

    async def read(self, keys: list[bytes]) -> dict[bytes, torch.Tensor]:
        """The embeddings of `keys` found (a miss, a bad file or a late read: left out)."""
        chains = await asyncio.gather(*(self.store.load_chain([k[:STORE_KEY_BYTES]]) for k in keys))
        return {
            k: found[0].clone().view(torch.float32).reshape(self.shape)
            for k, found in zip(keys, chains)
            if found
        }

    def write(self, key: bytes, embeds: torch.Tensor) -> None:
        """Queued on the store's writers; embeddings of another shape are not kept."""
        if tuple(embeds.shape) != self.shape or embeds.dtype != torch.float32:
            return
        payload = embeds.contiguous().view(torch.uint8).reshape(-1)
        self.store.submit_write(key[:STORE_KEY_BYTES], payload, self.traffic_class)

    async def close(self) -> None:
        await self.store.flush()
        await asyncio.to_thread(self.store.close)


@dataclass
class ImageEmbeddings:
    """Embeddings by sha256(model fingerprint | image digest), LRU within `budget_bytes`."""

    encoder: ImageEncoder
    fingerprint: bytes
    budget_bytes: int
    store: EmbeddingStore | None = None
    stats: ImageStats = field(default_factory=ImageStats)
    _cache: OrderedDict[bytes, torch.Tensor] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _pending: dict[bytes, asyncio.Future[torch.Tensor]] = field(default_factory=dict)
    _tasks: set[asyncio.Future[dict[bytes, torch.Tensor]]] = field(default_factory=set)

    def key(self, digest: bytes) -> bytes:
        return hashlib.sha256(self.fingerprint + digest).digest()

    async def spans(self, images: Sequence[ImageInput]) -> list[ImageSpan]:
        """The embeddings of `images`, each encoded at most once (raises EncoderFailed, or
        ImageRejected); an image is looked up (host, then store) before its pixels are made."""
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
            stored = await self.store.read(list(todo)) if self.store is not None else {}
            self.stats.store_hits += len(stored)
            left = {k: im for k, im in todo.items() if k not in stored}
            out: Sequence[torch.Tensor] = []
            if left:
                out = await self.encoder.encode(list(left.values()))
        except BaseException as e:  # cancelled too (the engine stopping): nobody waits on
            failed = e if isinstance(e, EncoderFailed) else EncoderFailed(str(e) or repr(e))
            for fut in futures.values():
                fut.set_exception(failed)  # an image rejected: others' requests may retry (503)
                fut.exception()  # retrieved: nobody else may be waiting
            if isinstance(e, ImageRejected):
                raise
            if not isinstance(e, Exception):
                raise
            raise failed from None
        finally:
            for k in futures:
                self._pending.pop(k, None)
        self.stats.encoded += len(left)
        encoded = {k: embeds.contiguous() for k, embeds in zip(left, out)}
        if self.store is not None:
            for k, embeds in encoded.items():
                self.store.write(k, embeds)
        result = {}
        for k in todo:
            embeds = stored[k] if k in stored else encoded[k]
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
        if self.store is not None:
            await self.store.close()


def _forget(tasks: set) -> Callable[[asyncio.Future], None]:
    """Drops a finished encoding from `tasks`, its exception retrieved (its caller may be
    gone)."""

    def done(task: asyncio.Future) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()

    return done
