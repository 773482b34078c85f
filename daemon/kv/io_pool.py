"""A thread pool for file I/O that may never return (a hung network file system): its threads
are daemon threads, so neither shutdown nor the interpreter's exit waits on a stuck one."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_Job = tuple[Future, Callable[..., Any], tuple, dict] | None
BACKGROUND_NICE = 10  # where SCHED_IDLE is not offered


def to_background() -> None:
    """Lower the calling thread's priority (Linux: per thread): SCHED_IDLE, else niced by
    BACKGROUND_NICE. A 2000-token prefill's 125 block writes on 2 cores slowed the next 15
    decode steps of SmolLM2-135M from 41 ms to 63-65 ms under nice 10, 53-55 under nice 19,
    46-51 under SCHED_IDLE."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)


class IoPool(Executor):
    def __init__(self, threads: int, name: str, background: bool = False) -> None:
        """`background`: work nobody waits on, which yields the cores to the forward's threads:
        the threads run under SCHED_IDLE where Linux offers it (a core only when no other
        thread wants it, and a waking thread takes it back at once), else niced by
        BACKGROUND_NICE."""
        self._background = background
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("the I/O pool is shut down")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(
        self, wait: bool = True, *, cancel_futures: bool = False, timeout: float | None = None
    ) -> list[str]:
        """Stops the threads once the queued jobs are done (`cancel_futures`: dropped instead),
        waiting up to `timeout` s when `wait`; returns the names of those still busy then."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if not wait:
            return [t.name for t in self._threads if t.is_alive()]
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def _work(self) -> None:
        if self._background:
            to_background()
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)
