"""The engine's KV handoffs in flight: a decode-side fetch and import per request (reserve,
fetch, read the full blocks left in the shared block store, check, import, or compute locally),
the prefill-side exports awaited (and the full blocks they leave in the store), and the
transfers waiting for the device thread's next run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
import torch

from daemon.kv.block_copy import BlockCopier
from daemon.kv.block_store import BlockStore
from daemon.kv.manager import KVManager
from daemon.kv.prefix import PrefixCache
from daemon.loop.handoff import (
    Fetched,
    HandoffFailed,
    HandoffStats,
    KVSource,
    LayoutMismatch,
    StoreOffer,
    after_blocks,
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
        store: BlockStore | None = None,
        copier: BlockCopier | None = None,
        store_wait_s: float = 1.0,
    ) -> None:
        """`timeout_s`: the most a decode-side handoff (reserving, fetching, importing) may
        take; `admit` queues a request whose KV is imported for scheduling, `compute` one
        that computes its prompt here (through the block store); `wake` wakes the engine loop
        for a transfer to run. `store` (with the runner's `copier`): the block store full
        blocks may go through, offered to prefill nodes and taken from decode nodes (None:
        every block goes over the wire); a prefill side waits `store_wait_s` at most for a
        block's store write, else sends the block."""
        self.kv, self.cache, self.prefix, self.timeout_s = kv, cache, prefix, timeout_s
        self._admit, self._compute, self._wake = admit, compute, wake
        usable = store is not None and copier is not None and prefix is not None
        self.store = store if usable else None
        self.copier, self.store_wait_s = copier, store_wait_s
        self.stats = HandoffStats()
        self.tasks: dict[str, asyncio.Task[None]] = {}  # request id -> its fetch and import
        self.exporting: dict[str, asyncio.Future[KVExport]] = {}  # prefill_export's waiters
        self._export_started: dict[str, float] = {}  # request id -> monotonic time
        self.pending: list[KVTransfer] = []  # for the device thread's next run

    @property
    def in_flight(self) -> int:
        return len(self.tasks) + len(self.exporting)

    @property
    def offer(self) -> StoreOffer | None:
        """This node's block store, as handoffs name it (None: not through the store)."""
        store = self.store
        if store is None or store.identity is None:
            return None
        return StoreOffer(store.identity, store.fingerprint.hex(), self.kv.prefix_block)

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
                got = await source.fetch(list(req.prompt_ids), keys, end, self.offer)
                fetched = time.monotonic()
                stored = await self._read_stored(got, keys, end)
                if stored is None:  # a stored block is missing, bad or late: all of it again
                    self.stats.store_fallbacks += 1
                    log.warning("kv_handoff_store_fallback", request_id=rid)
                    got, stored = await source.fetch(list(req.prompt_ids), keys, end), []
                    self._check(got, keys, end)
                read = time.monotonic()
                tables = [list(t) for t in self.kv.block_tables(rid)]
                loop = asyncio.get_running_loop()
                transfer = KVImport(
                    rid,
                    tables,
                    loop.create_future(),
                    export=got.export,
                    stored=stored,
                    stored_blocks=[
                        [tables[g][i] for g in self.kv.paged] for i in range(len(stored))
                    ],
                    copier=self.copier,
                )
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
            self.stats.bytes_imported += export_bytes(got.export)
            self.stats.blocks_from_store += len(stored)
            self.stats.bytes_from_store += sum(p.numel() for p in stored)
            self.stats.seconds["fetch"] += fetched - started
            self.stats.seconds["store"] += read - fetched
            self.stats.seconds["import"] += time.monotonic() - read
            req.num_computed = end
            if self.prefix is not None:
                self.prefix.imported(req)
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

    def _check(self, got: Fetched, keys: list[bytes], end: int) -> None:
        """LayoutMismatch unless `got` is the export of [n * block, end) after the first n of
        this prompt's full blocks, stored, and fits this cache."""
        n = len(got.stored)
        if n and (self.store is None or n * self.kv.prefix_block > end or got.stored != keys[:n]):
            raise LayoutMismatch(f"{n} stored blocks that are not this prompt's, or unasked")
        check_blocks(got.export, self.cache, self.kv, end, n * self.kv.prefix_block)

    async def _read_stored(
        self, got: Fetched, keys: list[bytes], end: int
    ) -> list[torch.Tensor] | None:
        """The payloads of the stored blocks, read (and their headers checked: fingerprint,
        key, checksum) by the prefix cache's store tier; None if one did not read back."""
        self._check(got, keys, end)
        if not got.stored:
            return []
        assert self.store is not None
        payloads = await self.store.load_chain(got.stored)
        return payloads if len(payloads) == len(got.stored) else None

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

    def read_out(self, request_id: str, ok: bool) -> None:
        """The export's request is computed and its KV read (`ok`), or it failed."""
        self.exporting.pop(request_id, None)
        started = self._export_started.pop(request_id, None)
        if started is not None and ok:
            self.stats.seconds["export"] += time.monotonic() - started

    async def leave_stored(
        self, export: KVExport, keys: list[bytes], offer: StoreOffer | None
    ) -> Fetched:
        """The prefill side: asked with `offer`, this node's own store, the leading full blocks
        of the export published in it (their writes waited for `store_wait_s` at most) stay
        out of it, named by their keys; any other block goes in the export."""
        if offer is None or offer != self.offer:
            return Fetched(export)
        assert self.store is not None
        started = time.monotonic()
        full = keys[: export.end // self.kv.prefix_block]
        n = await self.store.published(full, self.store_wait_s)
        self.stats.seconds["publish"] += time.monotonic() - started
        return Fetched(after_blocks(export, n, self.kv.prefix_block), full[:n])

    def exported(self, got: Fetched) -> None:
        self.stats.exported += 1
        self.stats.bytes_exported += export_bytes(got.export)
        self.stats.blocks_stored += len(got.stored)

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
