"""Prometheus metrics under the `deepinfer:` prefix, with vLLM's meanings where vLLM has the
metric: latency histograms observed per request, counters and gauges read from the engine's
own statistics when scraped (nothing is counted twice)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from daemon.kv.tier_stats import TIERS
from daemon.loop.engine import Engine
from daemon.loop.request import FinishReason, Request

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)


class EngineMetrics:
    """The engine's request observer (an Engine constructor argument), and the registry
    /metrics serves; `collect_engine` adds the engine's own statistics to it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "deepinfer:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "deepinfer:inter_token_latency_seconds",
            "Time between tokens.",
            buckets=_TOKEN,
            registry=r,
        )
        self.e2e = Histogram(
            "deepinfer:e2e_request_latency_seconds",
            "Arrival to finish, per request.",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            "deepinfer:request_queue_time_seconds",
            "Arrival to first scheduled step (including block-store reads).",
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "deepinfer:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "deepinfer:generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            "deepinfer:prompt_tokens_cached",
            "Prompt tokens whose KV came from the prefix cache, by tier.",
            ["tier"],
            registry=r,
        )
        self.finished = Counter(
            "deepinfer:request_success",
            "Finished requests by reason (stop, length, abort).",
            ["finished_reason"],
            registry=r,
        )

    def collect_engine(self, engine: Engine) -> None:
        """Serve `engine`'s gauges and counters too, read from it at each scrape."""
        self.registry.register(_EngineCollector(engine))

    # ---- engine observer (event loop) ----------------------------------------------------

    def on_token(self, req: Request) -> None:
        now = time.monotonic()
        stats = req.stats
        if stats.first_token_time is None:
            stats.first_token_time = now
            self.ttft.observe(now - req.arrival)
        elif stats.last_token_time is not None:
            self.itl.observe(now - stats.last_token_time)
        stats.last_token_time = now

    def on_finished(self, req: Request) -> None:
        self.e2e.observe(time.monotonic() - req.arrival)
        if req.stats.scheduled_time is not None:
            self.queue.observe(req.stats.scheduled_time - req.arrival)
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.generation_tokens.inc(len(req.output_ids))
        for tier, n in req.cache.tokens_by_tier.items():
            self.cached_tokens.labels(tier).inc(n)
        reason = req.finish_reason or FinishReason.ABORT
        self.finished.labels(reason.value).inc()


def _images(stats: dict) -> Iterator[Metric]:
    yield CounterMetricFamily(
        "deepinfer:images_encoded",
        "Images the vision encoder encoded (a cached image is not encoded again).",
        value=stats["images_encoded"],
    )
    yield CounterMetricFamily(
        "deepinfer:image_cache_hits",
        "Images whose embeddings were cached by content hash (or being encoded).",
        value=stats["image_cache_hits"],
    )
    yield CounterMetricFamily(
        "deepinfer:image_store_hits",
        "Images whose embeddings were read from the block store (a host-memory miss).",
        value=stats["image_store_hits"],
    )
    yield GaugeMetricFamily(
        "deepinfer:image_cache_bytes",
        "Host memory held by cached image embeddings.",
        value=stats["image_cache_bytes"],
    )


class _EngineCollector:
    """Gauges and cumulative counters straight from Engine.stats() at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for name, key, doc in (
            ("num_requests_running", "running", "Requests in the running batch."),
            ("num_requests_waiting", "waiting", "Requests waiting to be scheduled."),
            ("num_requests_loading", "loading", "Requests waiting for block-store reads."),
        ):
            yield GaugeMetricFamily(f"deepinfer:{name}", doc, value=stats[key])
        usage = GaugeMetricFamily(
            "deepinfer:kv_cache_usage_perc",
            "Fraction of KV blocks in use, by kind.",
            labels=["kind"],
        )
        for group, u in zip(self.engine.kv.groups, self.engine.kv.usage()):
            used = 1 - u.num_free / u.num_blocks if u.num_blocks else 0.0
            usage.add_metric([group.spec.name], used)
        yield usage
        preempted = self.engine.scheduler.num_preemptions
        yield CounterMetricFamily(
            "deepinfer:num_preemptions", "Requests preempted (freed, recomputed).", value=preempted
        )
        yield from _handoff(stats)
        if "images_encoded" in stats:
            yield from _images(stats)
        if "spec_drafts" in stats:
            yield from _spec(stats)
        if "prefix_requests" not in stats:
            return
        yield from self._prefix(stats)

    @staticmethod
    def _prefix(stats: dict) -> Iterator[Metric]:
        per_tier = {
            "lookups": CounterMetricFamily(
                "deepinfer:prefix_cache_block_lookups",
                "Prefix blocks looked for, by tier.",
                labels=["tier"],
            ),
            "hits": CounterMetricFamily(
                "deepinfer:prefix_cache_block_hits",
                "Prefix blocks found, by tier.",
                labels=["tier"],
            ),
            "bytes_read": CounterMetricFamily(
                "deepinfer:prefix_cache_read_bytes",
                "Bytes brought in (host: to the device; store: from files).",
                labels=["tier"],
            ),
            "bytes_written": CounterMetricFamily(
                "deepinfer:prefix_cache_written_bytes",
                "Bytes sent out (host: from the device; store: to files).",
                labels=["tier"],
            ),
        }
        rate = GaugeMetricFamily(
            "deepinfer:prefix_cache_hit_rate",
            "Block hit rate of each tier's lookups.",
            labels=["tier"],
        )
        for tier in TIERS:
            for key, family in per_tier.items():
                family.add_metric([tier], stats[f"prefix_{tier}_{key}"])
            rate.add_metric([tier], stats[f"prefix_{tier}_hit_rate"])
        yield from per_tier.values()
        yield rate
        yield CounterMetricFamily(
            "deepinfer:prefix_cache_queries",
            "Prompt tokens looked up.",
            value=stats["prefix_prompt_tokens"],
        )
        yield CounterMetricFamily(
            "deepinfer:prefix_cache_hits", "Prompt tokens found.", value=stats["prefix_hit_tokens"]
        )
        yield GaugeMetricFamily(
            "deepinfer:prefix_cache_token_hit_rate",
            "Prompt tokens found / looked up, since start.",
            value=stats["prefix_token_hit_rate"],
        )
        tiers = GaugeMetricFamily(
            "deepinfer:kv_cache_tier_bytes",
            "Prefix-cache content by tier: device (cached blocks), host, store (block files).",
            labels=["tier"],
        )
        for tier, key in (
            ("device", "prefix_cached_bytes"),
            ("host", "host_cache_bytes"),
            ("store", "kv_store_bytes"),
            ("swa", "swa_cache_bytes"),  # DeepSeek-V4 sliding-window snapshots, host memory
        ):
            if key in stats:
                tiers.add_metric([tier], stats[key])
        yield tiers
        if "swa_hits" in stats:
            swa = CounterMetricFamily(
                "deepinfer:swa_cache_lookups",
                "DeepSeek-V4 sliding-window snapshot lookups at admission, by result.",
                labels=["result"],
            )
            swa.add_metric(["hit"], stats["swa_hits"])
            swa.add_metric(["miss"], stats["swa_misses"])
            yield swa
        if "kv_store_writes" in stats:
            yield from _store(stats)


def _handoff(stats: dict) -> Iterator[Metric]:
    """Prefill/decode KV handoffs: requests imported or recomputed here (decode side), exports
    made here (prefill side), the reasons for recomputing, and the bytes moved."""
    total = CounterMetricFamily(
        "deepinfer:kv_handoff",
        "KV handoffs by result: imported (decode side), recomputed (decode side, locally "
        "instead), exported (prefill side).",
        labels=["result"],
    )
    for result in ("imported", "recomputed", "exported"):
        total.add_metric([result], stats[f"kv_handoff_{result}"])
    yield total
    reasons = CounterMetricFamily(
        "deepinfer:kv_handoff_recomputed",
        "Handoffs recomputed locally, by reason.",
        labels=["reason"],
    )
    for reason, n in stats["kv_handoff_recomputed_by_reason"].items():
        reasons.add_metric([reason], n)
    yield reasons
    moved = CounterMetricFamily(
        "deepinfer:kv_handoff_bytes",
        "Bytes of KV state moved by handoffs, by direction: imported and exported (over HTTP), "
        "from_store (full blocks the decode side read from the shared block store).",
        labels=["direction"],
    )
    moved.add_metric(["imported"], stats["kv_handoff_bytes_imported"])
    moved.add_metric(["exported"], stats["kv_handoff_bytes_exported"])
    moved.add_metric(["from_store"], stats["kv_handoff_bytes_from_store"])
    yield moved
    blocks = CounterMetricFamily(
        "deepinfer:kv_handoff_store_blocks",
        "Full blocks of handoffs through the shared block store: stored (prefill side: left in "
        "the store, not sent), read (decode side: read from it).",
        labels=["result"],
    )
    blocks.add_metric(["stored"], stats["kv_handoff_blocks_stored"])
    blocks.add_metric(["read"], stats["kv_handoff_blocks_from_store"])
    yield blocks
    yield CounterMetricFamily(
        "deepinfer:kv_handoff_store_fallbacks",
        "Handoffs whose stored blocks did not all read back (missing, corrupt or late): "
        "fetched again over HTTP, or computed here if that failed too.",
        value=stats["kv_handoff_store_fallbacks"],
    )
    seconds = CounterMetricFamily(
        "deepinfer:kv_handoff_seconds",
        "Seconds spent in handoffs that succeeded, by phase: fetch (decode side: route, the "
        "prefill node's compute, the payload), store (decode side: full blocks read from the "
        "block store), import (decode side, into the reserved blocks), export (prefill side: "
        "compute and device read), publish (prefill side: waiting for full blocks' store "
        "writes), send (prefill side: the payload).",
        labels=["phase"],
    )
    for phase, value in stats["kv_handoff_seconds_by_phase"].items():
        seconds.add_metric([phase], value)
    yield seconds


def _spec(stats: dict) -> Iterator[Metric]:
    """Speculative decoding (vLLM's spec_decode counters, and the verify budget)."""
    for name, key, doc in (
        ("num_drafts", "spec_drafts", "Drafts verified (one per request and step)."),
        ("num_draft_tokens", "spec_draft_tokens", "Draft tokens verified."),
        ("num_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted."),
        ("budget_tokens", "spec_budget_tokens", "Draft tokens chosen for verification."),
        ("budget_steps", "spec_steps", "Steps that verified drafts."),
    ):
        yield CounterMetricFamily(f"deepinfer:spec_decode_{name}", doc, value=stats[key])
    per_pos = CounterMetricFamily(
        "deepinfer:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft.",
        labels=["position"],
    )
    verified = CounterMetricFamily(
        "deepinfer:spec_decode_num_verified_tokens_per_pos",
        "Draft tokens verified, by position in the draft.",
        labels=["position"],
    )
    rate = GaugeMetricFamily(
        "deepinfer:spec_decode_acceptance_by_position",
        "Of the drafts verified that far, the fraction accepted at each position.",
        labels=["position"],
    )
    for j, (a, v, r) in enumerate(
        zip(
            stats["spec_accepted_by_position"],
            stats["spec_verified_by_position"],
            stats["spec_acceptance_by_position"],
        )
    ):
        per_pos.add_metric([str(j)], a)
        verified.add_metric([str(j)], v)
        rate.add_metric([str(j)], r)
    yield from (per_pos, verified, rate)
    for name, key, doc in (
        ("acceptance_rate", "spec_acceptance_rate", "Accepted / verified draft tokens."),
        (
            "mean_accepted_length",
            "spec_mean_accepted_length",
            "Tokens a verifying request gets per step (accepted drafts and one more).",
        ),
        ("budget_last", "spec_budget_last", "Draft tokens chosen in the last step."),
        ("budget_mean", "spec_budget_mean", "Draft tokens chosen per verifying step."),
    ):
        yield GaugeMetricFamily(f"deepinfer:spec_decode_{name}", doc, value=stats[key])


_STORE_FAILURES = {
    "failed_writes": "the file system refused a write (full, read-only)",
    "dropped_writes": "not attempted: the queue was full or writes were paused",
    "failed_reads": "I/O errors",
    "read_timeouts": "no answer by the deadline (a miss)",
    "bad_files": "damaged or foreign files (removed)",
}


def _store(stats: dict) -> Iterator[Metric]:
    if "kv_store_files" in stats:
        yield GaugeMetricFamily(
            "deepinfer:kv_store_files", "Block files in the store.", value=stats["kv_store_files"]
        )
    yield CounterMetricFamily(
        "deepinfer:kv_store_writes", "Blocks written to the store.", value=stats["kv_store_writes"]
    )
    failures = CounterMetricFamily(
        "deepinfer:kv_store_failures",
        "Block-store operations that failed, by kind: "
        + "; ".join(f"{k}: {v}" for k, v in _STORE_FAILURES.items()),
        labels=["kind"],
    )
    for kind in _STORE_FAILURES:
        failures.add_metric([kind], stats[f"kv_store_{kind}"])
    yield failures
