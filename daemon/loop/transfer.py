"""A request's KV moved on the device thread: a handoff's import into its reserved blocks, a
prefill's export out of them. The engine queues them; the runner runs them after a run's
cache ops (so a block's demotion is copied out before an import overwrites it), before its
forward; the engine settles them on the loop once that run is back."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from daemon.kv.block_copy import BlockCopier
from daemon.loop.handoff import HandoffFailed, LayoutMismatch, check_state
from daemon.models.base import KVExport, ModelCache


@dataclass(eq=False)
class KVTransfer(ABC):
    request_id: str
    tables: list[list[int]]  # a copy of the request's block tables when it was queued
    done: asyncio.Future[KVExport] = field(repr=False)
    error: BaseException | None = None

    def run(self, cache: ModelCache) -> None:
        """On the device thread; a failure is the transfer's, not the step's."""
        try:
            self._apply(cache)
        except Exception as e:  # noqa: BLE001 - any fault of the export is a failed handoff
            self.error = e

    @abstractmethod
    def _apply(self, cache: ModelCache) -> None: ...

    @abstractmethod
    def _result(self) -> KVExport: ...

    def settle(self) -> None:
        """On the loop, once the run that carried it is back."""
        if self.done.done():
            return  # its waiter is gone (the request was aborted)
        if self.error is None:
            self.done.set_result(self._result())
        elif isinstance(self.error, HandoffFailed):
            self.done.set_exception(self.error)
        else:
            failed = HandoffFailed(f"{type(self.error).__name__}: {self.error}")
            failed.__cause__ = self.error
            self.done.set_exception(failed)


@dataclass(eq=False)
class KVImport(KVTransfer):
    """Write `export` (checked against the cache's paged layout already) into the request's
    blocks, once its per-request state is found to fit too; the full blocks before its start
    from `stored` (block-store payloads, as `copier` gathers them: one per block, into
    `stored_blocks`, each its block in every paged group)."""

    export: KVExport | None = None
    stored: list[torch.Tensor] = field(default_factory=list, repr=False)
    stored_blocks: list[list[int]] = field(default_factory=list)
    copier: BlockCopier | None = field(default=None, repr=False)

    def _apply(self, cache: ModelCache) -> None:
        assert self.export is not None
        check_state(self.export, cache, self.tables)
        try:
            if self.stored:
                assert self.copier is not None
                self.copier.scatter(self.stored_blocks, self.stored)
            cache.import_kv(self.export, self.tables)
        except (ValueError, RuntimeError, TypeError) as e:  # what the copies raise on a misfit
            raise LayoutMismatch(f"the export does not fit this cache: {e}") from e

    def _result(self) -> KVExport:
        assert self.export is not None
        return self.export


@dataclass(eq=False)
class KVExportRead(KVTransfer):
    """Read the request's KV of [0, end) to the host."""

    end: int = 0
    export: KVExport | None = None

    def _apply(self, cache: ModelCache) -> None:
        self.export = cache.export_kv(self.tables, 0, self.end)

    def _result(self) -> KVExport:
        assert self.export is not None
        return self.export
