"""One HTTP request's engine requests: submit them all or none, stream their outputs merged,
and abort every unfinished one when the handler exits (done, failed, cancelled, disconnected)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

from daemon.api.codecs.base import Job
from daemon.api.http.cache_options import CacheOptions
from daemon.api.http.errors import bad_request, unavailable
from daemon.loop.engine import Engine, RequestRejected
from daemon.loop.handoff import KVSource
from daemon.loop.image_input import ImageInput
from daemon.loop.request import Request, RequestOutput


def submit_all(
    engine: Engine,
    base_id: str,
    jobs: list[Job],
    priority: int = 0,
    cache: CacheOptions = CacheOptions(),
    kv_source: KVSource | None = None,
    images: Sequence[ImageInput] = (),
) -> list[Request]:
    """Adds job i as request `{base_id}-{i}`; if one is rejected, none stay (400 or 503).
    `kv_source` (a routed request on a decode node): where the first job's prompt KV comes
    from; `images`: those every job's prompt splices in, their embeddings awaited (the text
    before the first one computed meanwhile; `Engine.images_ready`)."""
    reqs: list[Request] = []
    try:
        for i, (prompt_ids, params) in enumerate(jobs):
            reqs.append(
                engine.add_request(
                    prompt_ids,
                    params,
                    f"{base_id}-{i}",
                    priority,
                    traffic_class=cache.traffic_class,
                    cache_salt=cache.cache_salt,
                    kv_source=kv_source if i == 0 else None,
                    awaiting=images,
                )
            )
    except RequestRejected as e:
        _abort(engine, reqs)
        raise bad_request(str(e), e.param) from None
    except RuntimeError:  # the engine loop has failed
        _abort(engine, reqs)
        raise unavailable("the inference engine has failed; the server must be restarted") from None
    return reqs


class FanOut:
    """`async with FanOut(engine, reqs) as fan: async for index, output in fan: ...`"""

    def __init__(self, engine: Engine, reqs: list[Request]) -> None:
        self.engine = engine
        self.reqs = reqs
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> FanOut:
        self._tasks = [
            asyncio.create_task(self._pump(i, req), name=f"pump-{req.request_id}")
            for i, req in enumerate(self.reqs)
        ]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _abort(self.engine, self.reqs)  # first, synchronously: we may be being cancelled
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.reqs)
        while remaining:
            index, out = await self._queue.get()
            if isinstance(out, Exception):
                raise out
            if out.finished:
                remaining -= 1
            yield index, out

    async def _pump(self, index: int, req: Request) -> None:
        try:
            async for out in self.engine.stream(req):
                self._queue.put_nowait((index, out))
        except Exception as e:  # surfaces in the handler, which answers 500
            self._queue.put_nowait((index, e))


def _abort(engine: Engine, reqs: list[Request]) -> None:
    for req in reqs:
        if not req.finished:
            engine.abort(req.request_id)
