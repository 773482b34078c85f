"""The engine's KV handoffs in flight: a decode-side fetch and import per request (reserve,
fetch, check, import, or compute locally), the prefill-side exports awaited, and the transfers
waiting for the device thread's next run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from daemon.kv.manager import KVManager
from daemon.kv.prefix import PrefixCache
from daemon.loop.handoff import (
    HandoffFailed,
    HandoffStats,
    KVSource,
    LayoutMismatch,
    check_blocks,
    export_bytes,
)
from daemon.loop.request import Request, RequestStatus
from daemon.loop.transfer import KVExportRead, KVImport, KVTransfer
from daemon.models.base import KVExport, ModelCache

log = structlog.get_logger(__name__)

RESERVE_POLL_S = 0.005  # a handoff waiting for KV blocks to reserve looks again this often


class Handoffs:
    def __init__(
        self,
        kv: KVManager,
        cache: ModelCache,
        prefix: PrefixCache | None,
        timeout_s: float,
        *,
        admit: Callable[[Request], None],
        compute: Callable[[Request], None],
        wake: Callable[[], None],
    ) -> None:
        """`timeout_s`: the most a decode-side handoff (reserving, fetching, importing) may
        take; `admit` queues a request whose KV is imported for scheduling, `compute` one
        that computes its prompt here (through the block store); `wake` wakes the engine loop
        for a transfer to run."""
        self.kv, self.cache, self.prefix, self.timeout_s = kv, cache, prefix, timeout_s
        self._admit, self._compute, self._wake = admit, compute, wake
        self.stats = HandoffStats()
        self.tasks: dict[str, asyncio.Task[None]] = {}  # request id -> its fetch and import
        self.exporting: dict[str, asyncio.Future[KVExport]] = {}  # prefill_export's waiters
        self._export_started: dict[str, float] = {}  # request id -> monotonic time
        self.pending: list[KVTransfer] = []  # for the device thread's next run

    @property
    def in_flight(self) -> int:
        return len(self.tasks) + len(self.exporting)

    # ---- decode side ----------------------------------------------------------------------

    def start_import(self, req: Request, source: KVSource) -> None:
        req.status = RequestStatus.LOADING
        rid = req.request_id
        task = asyncio.create_task(self._import(req, source), name=f"kv-handoff-{rid}")
        self.tasks[rid] = task
        task.add_done_callback(lambda t: self.tasks.pop(rid) if self.tasks.get(rid) is t else None)

    async def _import(self, req: Request, source: KVSource) -> None:
        """Reserve the prompt's blocks (all of them, fresh: no prefix-cache match for this
        request), fetch [0, end), check it fits this cache, import it on the device thread,
        then admit the request with [0, end) computed: it computes the last prompt token and
        samples as usual. Any failure or the deadline: it computes its prompt here. An abort
        cancels this task (`abort`); the engine's release frees the blocks."""
        rid, end = req.request_id, req.num_prompt_tokens - 1
        stage = "no_room"
        transfer: KVImport | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                # the last prompt token's block too: its admission then needs no more
                while not self.kv.grow(rid, req.num_prompt_tokens):
                    await asyncio.sleep(RESERVE_POLL_S)
                stage = "timeout"
                keys = list(self.prefix.keys(req)) if self.prefix is not None else []
                started = time.monotonic()
                export = await source.fetch(list(req.prompt_ids), keys, end)
                fetched = time.monotonic()
                check_blocks(export, self.cache, self.kv, end)
                tables = [list(t) for t in self.kv.block_tables(rid)]
                loop = asyncio.get_running_loop()
                transfer = KVImport(rid, tables, loop.create_future(), export=export)
                self.queue(transfer)
                await transfer.done
        except TimeoutError:
            reason, error = stage, f"no answer in {self.timeout_s} s"
        except LayoutMismatch as e:
            reason, error = "layout", str(e)
        except HandoffFailed as e:
            reason, error = "failed", str(e)
        except OSError as e:
            reason, error = "connection", f"{type(e).__name__}: {e}"
        except Exception as e:  # a faulty source must not lose the request
            log.exception("kv_handoff_error", request_id=rid)
            reason, error = "error", f"{type(e).__name__}: {e}"
        else:
            self.stats.imported += 1
            self.stats.bytes_imported += export_bytes(export)
            self.stats.seconds["fetch"] += fetched - started
            self.stats.seconds["import"] += time.monotonic() - fetched
            req.num_computed = end
            self._admit(req)
            return
        finally:
            if transfer is not None and transfer in self.pending:
                self.pending.remove(transfer)  # not run yet: it never will
        if req.finished:
            return
        log.warning("kv_handoff_recomputed", request_id=rid, reason=reason, error=error)
        self.kv.free(rid)  # the reserved blocks (indexed by nothing) go back
        self.recompute(req, reason)

    def recompute(self, req: Request, reason: str) -> None:
        self.stats.recomputed[reason] += 1
        req.num_computed = 0
        self._compute(req)

    # ---- prefill side ---------------------------------------------------------------------

    def expect_export(self, request_id: str) -> asyncio.Future[KVExport]:
        done: asyncio.Future[KVExport] = asyncio.get_running_loop().create_future()
        self.exporting[request_id] = done
        self._export_started[request_id] = time.monotonic()
        return done

    def exported(self, request_id: str, export: KVExport | None) -> None:
        self.exporting.pop(request_id, None)
        started = self._export_started.pop(request_id, None)
        if export is not None:
            self.stats.exported += 1
            self.stats.bytes_exported += export_bytes(export)
            if started is not None:
                self.stats.seconds["export"] += time.monotonic() - started

    def sent(self, seconds: float) -> None:
        """The prefill side's payload of an export went out in `seconds` (the HTTP layer's)."""
        self.stats.seconds["send"] += seconds

    def export(self, req: Request, tables: list[list[int]]) -> None:
        """Read the request's computed KV (its blocks kept, out of the queues)."""
        done = self.exporting[req.request_id]
        self.queue(KVExportRead(req.request_id, tables, done, end=req.num_computed))

    # ---- both -------------------------------------------------------------------------------

    def queue(self, transfer: KVTransfer) -> None:
        self.pending.append(transfer)
        self._wake()

    def take(self) -> list[KVTransfer]:
        transfers, self.pending = self.pending, []
        return transfers

    def abort(self, request_id: str) -> None:
        """The request is aborted: its fetch is cancelled, a transfer not yet run never runs
        (its blocks may go to another request now), an export's waiter fails."""
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        self.pending = [t for t in self.pending if t.request_id != request_id]
        waiter = self.exporting.get(request_id)
        if waiter is not None and not waiter.done():
            waiter.set_exception(HandoffFailed(f"request {request_id} was aborted"))
