"""The async engine: the 3-stage overlap loop and the request-facing API.

    event loop:  schedule N+1 ──submit──►  ... process outputs of N ... schedule N+2
    device:            [ forward+sample N ][ forward+sample N+1 ][ ...
On an accelerator the loop starts on N's outputs once N+1 is queued on the device. With
overlap off, each step is scheduled only after the previous one's outputs are processed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from daemon.kv.block_store import BlockStore
from daemon.kv.manager import KVManager
from daemon.kv.prefix import PrefixCache
from daemon.kv.request_state import PrefixState
from daemon.kv.store_gc import StoreSweeper
from daemon.kv.tier_ops import CacheOps
from daemon.kv.traffic import TrafficClasses
from daemon.loop.handoff import Fetched, KVSource, StoreOffer
from daemon.loop.handoffs import Handoffs
from daemon.loop.image_input import ImageInput
from daemon.loop.images import ImageEmbeddings, ImageSpan
from daemon.loop.moe_control import MoEControl
from daemon.loop.openmp import release_thread_team
from daemon.loop.output import OutputProcessor
from daemon.loop.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from daemon.loop.runner import ModelRunner, StepResult
from daemon.loop.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerStep,
    StoreRead,
    decode_context,
)
from daemon.loop.spec.device_drafter import DeviceDrafter, EarlyDraft
from daemon.loop.transfer import KVTransfer
from daemon.models.base import KVExport
from daemon.models.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)


class RequestObserver(Protocol):
    def on_token(self, req: Request) -> None: ...
    def on_finished(self, req: Request) -> None: ...


@dataclass
class Inflight:
    """A step (None: cache ops run while idle) handed to the device thread."""

    step: SchedulerStep | None
    ops: CacheOps
    future: asyncio.Future
    launched: asyncio.Future | None = None  # resolved once its work is queued on the device
    transfers: list[KVTransfer] = field(default_factory=list)  # handoff imports and exports
    prepare_seconds: float = 0.0  # the loop thread's `ModelRunner.prepare`
    # the loop thread's `Scheduler.schedule` (drafting included) and taking the cache ops
    schedule_seconds: float = 0.0


def _resolver(loop: asyncio.AbstractEventLoop, launched: asyncio.Future) -> Callable[[], None]:
    """A callable for the device thread that resolves `launched` on the loop."""

    def resolve() -> None:
        if not launched.done():
            launched.set_result(None)

    return lambda: loop.call_soon_threadsafe(resolve)


class RequestRejected(ValueError):
    """The request can never run here (too long for the context or the KV pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        kv: KVManager,
        scheduler: Scheduler,
        tokenizer: TextTokenizer | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        overlap: bool = True,
        executor: Executor | None = None,
        *,
        prefix: PrefixCache | None = None,
        store: BlockStore | None = None,
        sweeper: StoreSweeper | None = None,
        sweep_interval_s: float = 300.0,
        moe: MoEControl | None = None,
        observer: RequestObserver | None = None,
        handoff_timeout_s: float = 30.0,
        handoff_min_tokens: int = 2,
        handoff_store: bool = True,
        handoff_store_wait_s: float = 1.0,
        images: ImageEmbeddings | None = None,
    ) -> None:
        """`prefix`: the scheduler's prefix cache; `store`: its block store, which the engine
        reads before admissions and flushes and closes on stop; `sweeper` expires the store's
        files every `sweep_interval_s`; `moe`: the MoE controller, for administration;
        `observer`: told of each request's tokens and end (the metrics); `handoff_timeout_s`:
        the most a KV handoff (reserving blocks, fetching, importing) may take before the
        request computes its prompt here instead; a prompt shorter than `handoff_min_tokens`
        is computed here without one (cheaper than waiting behind a prefill node's long
        prompts); `handoff_store`: full blocks of a handoff may go through the block store
        (`store`, when both nodes have the same), a prefill side waiting `handoff_store_wait_s`
        at most for a block's write before it sends the block instead; `images`: the image
        embeddings of a vision-language model (None: the engine takes no images)."""
        self.handoff_min_tokens = max(2, handoff_min_tokens)
        self.runner = runner
        self.images = images
        self.kv = kv
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.overlap = overlap
        self.outputs = OutputProcessor(tokenizer, max_model_len)
        self.requests: dict[str, Request] = {}
        # the device worker: one thread, steps in order (expert parallel: a LockstepExecutor)
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")
        # a CPU forward: its OpenMP team is the only one while the engine works, none while it
        # idles (a lockstep worker keeps stepping when idle: it keeps its team)
        self._one_team = runner.cpu_threads > 0
        self._idle_team_release = self._one_team and executor is None
        self.moe = moe
        self.prefix = prefix
        self.store = store
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loads: set[asyncio.Task[None]] = set()  # block-store reads before admission
        self.sweeper = sweeper
        self.sweep_interval_s = sweep_interval_s
        self._sweep_task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.steps = 0
        self.error: BaseException | None = None
        self.failed = asyncio.Event()  # set with `error`: the loop is gone, the process must go
        self.observer = observer
        self.handoffs = Handoffs(
            kv,
            runner.cache,
            prefix,
            handoff_timeout_s,
            admit=self._admit_imported,
            compute=self._enqueue,
            wake=self._wake,
            store=store if handoff_store else None,
            copier=runner.copier,
            store_wait_s=handoff_store_wait_s,
        )

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="engine-loop")
            worker_failure = getattr(self._executor, "failure", None)  # an EP lockstep worker's
            if worker_failure is not None:  # fails the engine also while it idles
                asyncio.wrap_future(worker_failure).add_done_callback(self._on_worker_failure)
        if self.sweeper is not None and self._sweep_task is None:
            self._sweep_task = asyncio.create_task(self._sweep_store(), name="kv-store-gc")

    async def stop(self) -> None:
        tasks = [
            t
            for t in (self._task, self._sweep_task, *self._loads, *self.handoffs.tasks.values())
            if t is not None
        ]
        for task in tasks:
            task.cancel()
        # a failed loop's error is `self.error`, logged when it failed: stopping goes on
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._sweep_task = None
        if self.images is not None:
            await self.images.close()
        for req in list(self.requests.values()):
            self.abort(req.request_id)  # also wakes anyone still reading its stream
        await asyncio.to_thread(self._executor.shutdown, True)  # EP: until every rank stops
        store = self.store
        if store is not None:
            await store.flush()  # finished work is kept
            await asyncio.to_thread(store.close)  # waits on stuck I/O threads: off the loop

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        traffic_class: str = "chat",
        cache_salt: bytes = b"",
        kv_source: KVSource | None = None,
        images: list[ImageSpan] | None = None,
        awaiting: Sequence[ImageInput] = (),
    ) -> Request:
        """A request to generate for; with `kv_source` its prompt's KV state is fetched from
        there first (the decode side of a handoff), else, or if that fails, computed here.
        `images`: embeddings (from `encode_images`) that replace the embeddings of their
        placeholder positions; `awaiting`: images whose embeddings come later (`images_ready`),
        the text before the first one computed meanwhile."""
        self._check(prompt_ids, params)
        spans = [(s.start, s.end, s.digest) for s in images or ()]
        if awaiting:
            if self.images is None:
                raise RequestRejected("this model does not take images", "messages")
            n = self.runner.model.image_tokens
            spans = [(im.start, im.start + n, im.digest) for im in awaiting]
        if spans and (kv_source is not None or any(end > len(prompt_ids) for _, end, _ in spans)):
            raise RequestRejected("the images' placeholders lie outside the prompt", "messages")
        req = self._new_request(prompt_ids, params, request_id, priority, traffic_class, cache_salt)
        if spans:
            req.images = list(images or ())
            req.prefix.content = spans
            req.images_until = min(start for start, _, _ in spans) if awaiting else None
        if kv_source is None:
            self._enqueue(req)
        elif len(prompt_ids) < self.handoff_min_tokens or params.prompt_logprobs is not None:
            # too little to move, or each prompt position's logits are wanted here
            self.handoffs.recompute(
                req,
                "short_prompt" if len(prompt_ids) < self.handoff_min_tokens else "prompt_logprobs",
            )
        else:
            self.handoffs.start_import(req, kv_source)
        return req

    def images_ready(self, req: Request, images: list[ImageSpan]) -> None:
        """The embeddings of the images `req` awaits: its placeholders may be computed now."""
        if [(s.start, s.end, s.digest) for s in images] != req.prefix.content:
            raise ValueError("these are not the images the request awaits")
        req.images, req.images_until = list(images), None
        self._wakeup.set()

    async def encode_images(self, images: list[ImageInput]) -> list[ImageSpan]:
        """The embeddings of a request's images, from the cache or the encoder (raises
        `EncoderFailed`)."""
        if self.images is None:
            raise RequestRejected("this model does not take images", "messages")
        return await self.images.spans(images)

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if self.error is not None:
            raise RuntimeError("the engine loop has failed") from self.error
        if not prompt_ids:
            raise RequestRejected("the prompt is empty", "prompt")
        total = len(prompt_ids) + params.max_tokens
        if len(prompt_ids) >= self.max_model_len or total > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {len(prompt_ids)} prompt tokens and asks for {params.max_tokens} more",
                "prompt" if len(prompt_ids) >= self.max_model_len else "max_tokens",
            )
        if total > self.kv.capacity_tokens():
            raise RequestRejected(
                f"the request needs {total} tokens of KV memory; the pool holds {self.kv.capacity_tokens()}",
                "prompt",
            )
        vocab = self.runner.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})", "prompt")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestRejected(f"logit_bias token ids must lie in [0, {vocab})", "logit_bias")

    def _new_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        priority: int,
        traffic_class: str,
        cache_salt: bytes,
    ) -> Request:
        req = Request(
            request_id=request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            prompt_ids=list(prompt_ids),
            params=params,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            prefix=PrefixState(cache_salt=cache_salt, traffic_class=traffic_class),
        )
        if req.request_id in self.requests:
            raise RequestRejected(f"request id {req.request_id!r} is already in use", "request_id")
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt_ids)  # the first token has none
        self.requests[req.request_id] = req
        self.outputs.add(req)
        return req

    def _enqueue(self, req: Request) -> None:
        """Into the scheduler's queue, after reading what the block store has of its prefix."""
        prefix = self.prefix
        store_keys = prefix.store_keys(req) if prefix is not None else []
        if store_keys:
            self._start_load(StoreRead(req, store_keys))
        else:
            self.scheduler.add(req)
            self._wakeup.set()

    def _start_load(self, read: StoreRead) -> None:
        read.request.status = RequestStatus.LOADING
        task = asyncio.create_task(self._load_from_store(read.request, read.keys))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load_from_store(self, req: Request, keys: list[bytes]) -> None:
        """Read the request's blocks from the store while it (alone) waits; a failure is a miss."""
        prefix, store = self.prefix, self.store
        assert prefix is not None and store is not None
        try:
            payloads = await store.load_chain(keys)
        except Exception:
            log.exception("kv_store_load_failed", request_id=req.request_id)
            payloads = []
        if req.finished:
            return
        prefix.receive(req, keys, payloads)
        self.scheduler.add(req)
        self._wakeup.set()

    # ---- KV handoff ---------------------------------------------------------------------

    def _admit_imported(self, req: Request) -> None:
        self.scheduler.add(req)
        self._wakeup.set()

    def _wake(self) -> None:
        self._wakeup.set()

    async def prefill_export(
        self,
        prompt_ids: list[int],
        request_id: str,
        cache_salt: bytes = b"",
        traffic_class: str = "chat",
        store: StoreOffer | None = None,
    ) -> Fetched:
        """The prefill side of a handoff: compute positions [0, len - 1) of the prompt (prefix
        cache hits used as for any request), export their KV state to the host and release
        the request (its full blocks stay in the prefix cache and go to the store as for any
        finished request). Asked with `store`, the decode node's block store, and that is
        this node's too, the leading full blocks published in it are left out of the export
        (`Fetched.stored` names them). Cancelling it frees everything the request holds.
        Raises RequestRejected for a prompt this engine cannot take, HandoffFailed if the
        request is aborted (the engine stops or fails) or its export fails."""
        if len(prompt_ids) < 2:
            raise RequestRejected("a KV handoff needs a prompt of at least 2 tokens", "prompt")
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self._check(prompt_ids, params)
        # the last token is the decode side's: the request's prompt stops before it, and its
        # one sample is never used (the engine exports instead, see `_prefilled`)
        req = self._new_request(prompt_ids[:-1], params, request_id, 0, traffic_class, cache_salt)
        done = self.handoffs.expect_export(req.request_id)
        export: KVExport | None = None
        try:
            self._enqueue(req)
            export = await done
            keys = self.prefix.keys(req) if self.prefix is not None else []
            if not req.finished:
                self._finish(req, FinishReason.LENGTH)
        finally:
            self.handoffs.read_out(req.request_id, export is not None)
            if not req.finished:
                self.abort(req.request_id)
        assert export is not None
        got = await self.handoffs.leave_stored(export, keys, store)
        self.handoffs.exported(got)
        return got

    def _prefilled(self, req: Request) -> None:
        """An export's request has computed its prompt: park it (blocks kept) and read them."""
        if req.status != RequestStatus.RUNNING:
            req.num_sampled_scheduled = 0  # preempted while its last chunk ran: computes again
            return
        if self.prefix is not None:  # its last full blocks' store writes go with the export
            self.prefix.register(req)
        self.scheduler.park(req)
        self.handoffs.export(req, [list(t) for t in self.kv.block_tables(req.request_id)])

    async def _sweep_store(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(self.sweeper.store.pool, self.sweeper.sweep)
            except Exception:
                log.exception("kv_store_sweep_failed")
            await asyncio.sleep(self.sweep_interval_s)

    async def stream(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs; closing the iterator early aborts the request."""
        outputs = self.outputs.queue(req)
        try:
            while True:
                out = await outputs.get()
                yield out
                if out.finished:
                    return
        finally:
            if not req.finished:
                self.abort(req.request_id)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        req = self.add_request(prompt_ids, params, request_id, priority)
        async for out in self.stream(req):
            yield out

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            log.info("request_aborted", request_id=request_id, output_tokens=len(req.output_ids))
            self.handoffs.abort(request_id)
            self._finish(req, FinishReason.ABORT)
            self.outputs.emit_abort(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.finished(req)
        if self.observer is not None:
            self.observer.on_finished(req)
        self.outputs.remove(req)
        self.requests.pop(req.request_id, None)

    @property
    def traffic_classes(self) -> TrafficClasses | None:
        prefix = self.prefix
        return prefix.classes if prefix is not None else None

    def stats(self) -> dict[str, object]:
        usage = self.kv.usage()
        prefix = self.prefix
        return (
            {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "loading": len(self._loads),
                "kv_handoffs_in_flight": self.handoffs.in_flight,
                "kv_blocks_total": sum(u.num_blocks for u in usage),
                "kv_blocks_free": sum(u.num_free for u in usage),
                "steps": self.steps,
            }
            | (prefix.snapshot_stats() if prefix is not None else {})
            | (spec.as_dict() if (spec := self.scheduler.speculator) is not None else {})
            | self._store_stats()
            | self.handoffs.stats.as_dict()
            | self._image_stats()
        )

    def _image_stats(self) -> dict[str, object]:
        images = self.images
        if images is None:
            return {}
        return images.stats.as_dict() | {"image_cache_bytes": images.cached_bytes}

    def _store_stats(self) -> dict[str, object]:
        usage = self.sweeper.store.usage if self.sweeper is not None else None
        return (
            {} if usage is None else {"kv_store_files": usage.files, "kv_store_bytes": usage.bytes}
        )

    # ---- the loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        prefix = self.prefix
        # accelerators: the loop's work for step N waits until step N+1 is queued on the
        # device; else the two threads' Python would take turns on the GIL instead of the
        # loop's turn overlapping the device's
        signal = self.overlap and self.runner.signals_launch
        inflight: deque[Inflight] = deque()
        try:
            while True:
                if self._one_team:
                    release_thread_team()  # this thread's, if anything here made one
                step = None
                scheduled_at = time.perf_counter()
                if self.overlap or not inflight:
                    step = self.scheduler.schedule(overlapped=bool(inflight))
                    if step is not None and step.store_reads:
                        for read in step.store_reads:
                            self._start_load(read)
                        if not step.seqs:
                            step = None
                ops = prefix.take_ops() if prefix is not None else CacheOps()
                transfers = self.handoffs.take()  # after the ops: demotions copied out first
                if step is not None:
                    started = time.perf_counter()
                    prepared = self.runner.prepare(step, self.kv, ops)
                    prepared_in = time.perf_counter() - started
                    prepared.transfers = transfers
                    launched = loop.create_future() if signal else None
                    args = (prepared, _resolver(loop, launched)) if launched else (prepared,)
                    future = loop.run_in_executor(self._executor, self.runner.execute, *args)
                    took = (prepared_in, started - scheduled_at)
                    inflight.append(Inflight(step, ops, future, launched, transfers, *took))
                    self.steps += 1
                elif ops or transfers:
                    future = loop.run_in_executor(
                        self._executor, self.runner.execute_cache_ops, ops, transfers
                    )
                    inflight.append(Inflight(None, ops, future, transfers=transfers))
                if inflight and (step is None or len(inflight) > 1 or not self.overlap):
                    done = inflight.popleft()
                    result = await done.future
                    if inflight and inflight[0].launched is not None:
                        following = inflight[0]
                        await asyncio.wait(
                            (following.launched, following.future),
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    if prefix is not None:
                        prefix.completed(done.ops)
                    for transfer in done.transfers:
                        transfer.settle()
                    if done.step is not None:
                        self._traced(done, result.seconds)
                        self._timed(done.step, done.prepare_seconds + result.seconds)
                        self._process(done.step, result)
                elif not inflight:
                    self._wakeup.clear()
                    if not self.scheduler.has_work:
                        if self._idle_team_release:  # queued: runs before any next step
                            self._executor.submit(release_thread_team)
                        await self._wakeup.wait()
                    else:
                        await asyncio.sleep(0.001)  # work exists but nothing fits yet
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.exception("engine_loop_failed")
            self._fail(e)
            raise

    def _on_worker_failure(self, done: asyncio.Future[None]) -> None:
        if not done.cancelled():
            self._fail(done.exception())

    def _fail(self, error: BaseException | None) -> None:
        """The engine cannot step any more: every request ends with an error, `failed` is set."""
        if self.error is not None or error is None:
            return
        self.error = error
        self.failed.set()
        for req in list(self.requests.values()):
            self.abort(req.request_id)

    def _process(self, step: SchedulerStep, result: StepResult) -> None:
        for i, first, entries in result.prompt_logprobs:
            scored = step.seqs[i].request.prompt_logprobs
            scored[first : first + len(entries)] = entries
        samples = iter(zip(result.tokens, result.logprobs))
        sample = 0
        for seq in step.seqs:
            req = seq.request
            req.num_inflight_steps -= 1
            if not seq.samples:
                continue
            token, logprob = next(samples)
            tokens, logprobs = [token], [logprob] if logprob else []
            if seq.draft or seq.proposal is not None:  # a grammar may have cut every draft
                accepted = result.accepted[sample]
                tokens[:0] = accepted
                logprobs[:0] = result.accepted_logprobs[sample]
                self._verified(seq, len(accepted), result.rolled_back[sample])
            drafted = result.drafts[sample] if result.drafts else None
            sample += 1
            if req.finished:
                continue  # aborted, or finished by an earlier token while this step ran
            if req.request_id in self.handoffs.exporting:
                self._prefilled(req)  # its one sample is not an output
                continue
            if self.observer is not None:
                self.observer.on_token(req)
            finish = None
            for n, t in enumerate(tokens, 1):
                # a stop ends it mid-way: the tokens after are dropped
                finish = self.outputs.append_token(req, t, logprobs[n - 1] if logprobs else None)
                if finish is not None:
                    break
            self.outputs.emit(req, tokens[:n], logprobs[:n], finish)
            if finish is not None:
                self._finish(req, finish)
            elif drafted is not None:
                self._drafted(req, drafted)
        self._wakeup.set()

    def _traced(self, done: Inflight, execute: float) -> None:
        """Each step's shape and time, at debug level (below it, nothing is counted)."""
        if done.step is None or not log.is_enabled_for(logging.DEBUG):
            return
        seqs = done.step.seqs
        log.debug(
            "step",
            seqs=len(seqs),
            tokens=sum(s.num_tokens for s in seqs),
            chunk_tokens=sum(s.num_tokens for s in seqs if s.order == 2),
            drafts=sum(len(s.draft) for s in seqs),
            block_saves=sum(len(b.blocks) for b in done.ops.block_saves),
            block_loads=sum(len(b.blocks) for b in done.ops.block_loads),
            schedule_ms=round(done.schedule_seconds * 1e3, 2),
            prepare_ms=round(done.prepare_seconds * 1e3, 2),
            execute_ms=round(execute * 1e3, 2),
            **self._predicted(done.step),
        )

    def _predicted(self, step: SchedulerStep) -> dict[str, float]:
        """What the speculator's cost priced the step at before it ran (prepare and execute),
        to trace beside the measured time: where the two part, the policy misjudges drafts."""
        spec = self.scheduler.speculator
        seconds = None if spec is None else spec.price(*_priced(step))
        return {} if seconds is None else {"predicted_ms": round(seconds * 1e3, 2)}

    def _timed(self, step: SchedulerStep, seconds: float) -> None:
        """A step's measured time, for the speculator's cost: its draft rows apart from its
        other tokens (the policy moves drafts; the chunks are what admission left it)."""
        spec = self.scheduler.speculator
        if spec is None:
            return
        num_tokens, num_seqs, num_drafts, context = _priced(step)
        spec.observe_step(num_tokens, num_seqs, num_drafts, seconds, context)

    def _drafted(self, req: Request, drafted: EarlyDraft) -> None:
        """Drafts the runner made after this step's token (on the device), for the drafter."""
        spec = self.scheduler.speculator
        if spec is not None and isinstance(spec.drafter, DeviceDrafter):
            spec.drafter.receive(req, drafted)

    def _verified(self, seq: ScheduledSeq, accepted: int, rolled_back: int | None) -> None:
        """A verify step's bookkeeping (the scheduler's) and its outcome (the speculator's)."""
        req, spec = seq.request, self.scheduler.speculator
        self.scheduler.verified(seq, accepted, rolled_back)
        if spec is not None and seq.proposal is not None and not req.finished:
            spec.observe(req, seq.proposal, len(seq.draft), accepted)


def _priced(step: SchedulerStep) -> tuple[int, int, int, float | None]:
    """What a step's cost is priced by: its tokens, sequences, draft rows and decode context."""
    seqs = step.seqs
    return (
        sum(s.num_tokens for s in seqs),
        len(seqs),
        sum(len(s.draft) for s in seqs),
        decode_context(seqs),
    )
