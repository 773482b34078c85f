"""The device worker under expert parallelism: ranks step together.

Each iteration the ranks agree (one small all-reduce) on whether anyone has a step, on the
statistics/rebalance schedule and on stopping; a rank with a step runs it, a rank without
one runs an empty step (its MoE layers still exchange tokens), then all run the same
`after_step`. Cache-only jobs run locally at once. Stopping waits until every rank stops.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import structlog
import torch
import torch.distributed as dist

from daemon.moe.controller import Decisions, MoEController
from daemon.moe.ep import EPGroup

log = structlog.get_logger(__name__)

IDLE_SLEEP_S = (0.0005, 0.02)  # back-off between empty agreements while no rank has work


class LockstepExecutor(Executor):
    def __init__(
        self,
        ep: EPGroup,
        controller: MoEController,
        is_step: Callable[[Callable[..., Any]], bool],
        idle_step: Callable[[], None],
    ) -> None:
        self.ep, self.controller = ep, controller
        self.is_step, self.idle_step = is_step, idle_step
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future]] = (
            queue.SimpleQueue()
        )
        self._stopping = threading.Event()
        # the error that ended the worker (a peer gone: its connections reset); the engine
        # fails with it, even while idle
        self.failure: Future[None] = Future()
        self._failing = threading.Lock()  # no job queued after the worker has failed
        self._pending: tuple[Callable[..., Any], tuple, Future] | None = None
        self.iterations = 0
        self._thread = threading.Thread(target=self._run, name="device-lockstep", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._failing:
            if self.failure.done():
                future.set_exception(self.failure.exception())
            else:
                self._jobs.put((fn, args, future))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._stopping.set()
        if wait:
            self._thread.join()

    def _next_step(self) -> tuple[Callable[..., Any], tuple, Future] | None:
        """Runs queued cache-only jobs; returns the next step job, if one is queued."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return None
            if self.is_step(job[0]):
                return job
            self._call(job)

    def _run(self) -> None:
        try:
            self._iterate()
        except BaseException as e:
            log.error("ep_lockstep_failed", rank=self.ep.rank, error=str(e))
            with self._failing:
                self.failure.set_exception(e)
            jobs = [self._pending] if self._pending is not None else []
            while not self._jobs.empty():
                jobs.append(self._jobs.get_nowait())
            for _, _, future in jobs:  # none may wait forever
                if future.set_running_or_notify_cancel():
                    future.set_exception(e)

    def _iterate(self) -> None:
        sleep = IDLE_SLEEP_S[0]
        while True:
            self._pending = self._pending or self._next_step()
            due = self.controller.schedule() if self.ep.rank == 0 else Decisions()
            flags = torch.tensor(
                [
                    self._pending is not None,
                    not (self._stopping.is_set() and self._jobs.empty()),
                    self.controller.rebalance_requested(),
                    due.collect,
                    due.rebalance,
                ],
                dtype=torch.int64,
            )
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ep.control)
            has_step, running, requested, collect, scheduled = flags.tolist()
            if not has_step and not requested:
                if not running:
                    return
                time.sleep(sleep)
                sleep = min(2 * sleep, IDLE_SLEEP_S[1])
                continue
            sleep = IDLE_SLEEP_S[0]
            self.iterations += 1
            if self._pending is not None:
                job, self._pending = self._pending, None
                self._call(job)
            else:
                self.idle_step()
            self.controller.after_step(
                Decisions(
                    collect=bool(collect or requested), rebalance=bool(requested or scheduled)
                )
            )

    @staticmethod
    def _call(job: tuple[Callable[..., Any], tuple, Future]) -> None:
        fn, args, future = job
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # the engine loop sees it when it awaits the future
            future.set_exception(e)
