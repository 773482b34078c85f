"""Assemble an engine from settings: checkpoint, device, KV memory, runner and scheduler."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import structlog
import torch

from daemon.build.config import EngineConfig
from daemon.build.demo import default_name, is_demo, model_path
from daemon.build.device import kernels_widen_bf16, resolve_device, resolve_dtype
from daemon.build.images import RemoteEncoder, image_embeddings
from daemon.build.moe import forward_listener, lockstep_executor, moe_controller
from daemon.build.mtp import mtp_network
from daemon.build.mtp import state_bytes as mtp_state_bytes
from daemon.build.paths import gguf_cache, use_compile_cache_dir
from daemon.build.speculation import (
    bounded_by_draft,
    build_speculator,
    draft_layers_of,
    draft_network,
    implied,
    load_draft_model,
    mtp_for,
    target_share,
)
from daemon.build.startup import failing_as
from daemon.kv.block_store import BlockStore
from daemon.kv.host_tier import HostTier
from daemon.kv.manager import KVBudgetTooSmall, KVManager, pool_sizes
from daemon.kv.prefix import PrefixCache
from daemon.kv.spec import KVGroup
from daemon.kv.store_gc import StoreSweeper
from daemon.kv.swa_cache import SWACache
from daemon.kv.tier_ops import TierQueue
from daemon.kv.traffic import TrafficClasses
from daemon.loop.engine import Engine
from daemon.loop.metrics import EngineMetrics
from daemon.loop.runner import ModelRunner
from daemon.loop.scheduler import Scheduler
from daemon.models.base import Model
from daemon.models.gguf_checkpoint.reader import find_gguf
from daemon.models.loader import ModelLoadError, checkpoint_dtype, load_model, read_config
from daemon.models.rope import UnsupportedRope
from daemon.models.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)

KV_LAYOUT = "deepinfer-kv-1"  # bump when a cache's block layout changes: old store files miss


def build_engine(
    cfg: EngineConfig,
    metrics: EngineMetrics | None = None,
    handoff_timeout_s: float = 30.0,
    handoff_min_tokens: int = 2,
    remote_images: RemoteEncoder | None = None,
    handoff_store: bool = True,
    handoff_store_wait_s: float = 1.0,
) -> tuple[Engine, str]:
    """The engine and the name it serves the model under; `metrics`: its request observer
    (what /metrics serves), None for none; `handoff_timeout_s`: the most a KV handoff from a
    prefill node may take before the prompt is computed here; `handoff_min_tokens`: shorter
    prompts are computed here without one; `handoff_store`: a handoff's full blocks may go
    through the block store (a prefill side waiting `handoff_store_wait_s` at most for a
    block's write); `remote_images`: makes the encoder a vision
    model's images go to (encoder nodes; None: its own tower). A model, device or KV budget
    that cannot serve raises StartupError."""
    cfg = implied(cfg)
    with failing_as("model", ModelLoadError, OSError):
        path = model_path(cfg)
        hf_config = read_config(path, gguf_cache(cfg))
    with failing_as(f"device {cfg.device}", RuntimeError, ValueError):
        device = resolve_device(cfg.device)
    dtype = resolve_dtype(
        cfg.dtype,
        checkpoint_dtype(hf_config),
        device,
        widened_bf16=lambda: kernels_widen_bf16(hf_config.get("model_type")),
    )
    with failing_as(f"model {path}", ModelLoadError, UnsupportedRope, OSError):
        loaded = load_model(path, device, dtype, gguf_cache(cfg))
    model = loaded.model
    # `tokenizers` raises plain Exceptions; whatever it is, the files cannot serve
    with failing_as(f"tokenizer {find_gguf(path) or path / 'tokenizer.json'}", Exception):
        tokenizer = TextTokenizer.from_dir(path, hf_config, gguf_cache(cfg))
    max_model_len = min(cfg.max_model_len or model.max_model_len, model.max_model_len)
    if cfg.max_model_len and cfg.max_model_len > max_model_len:
        log.warning("max_model_len_lowered", asked=cfg.max_model_len, model_supports=max_model_len)
    groups = model.kv_groups(dtype, cfg.block_size)
    kv_memory = int(cfg.kv_cache_memory_gb * 2**30)
    draft: tuple[Model, list[KVGroup]] | None = None
    if cfg.speculative == "draft-model":
        draft = load_draft_model(cfg, model, groups, tokenizer, device, dtype)
        max_model_len = bounded_by_draft(draft[0], max_model_len)
        # the draft's cache has as many blocks as the target's: the budget pays for both
        kv_memory = int(kv_memory * target_share(groups, draft[1]))
    mtp = mtp_for(cfg, model) if cfg.speculative == "mtp" else None
    if mtp is not None:
        kv_memory -= mtp_state_bytes(mtp, cfg.num_speculative_tokens, cfg.max_num_seqs)
    with failing_as("KV cache", KVBudgetTooSmall):
        num_blocks = pool_sizes(groups, kv_memory, cfg.max_num_seqs)
    cpu_threads = _cpu_threads(cfg)
    # inductor's code (the compiled CPU forward) is kept with ours unless told otherwise
    use_compile_cache_dir()
    overlap = resolve_overlap(cfg, device, cpu_threads)
    # before the runner: it takes the listener, and EP drops others' experts before the KV cache
    moe = moe_controller(cfg, model, device)
    draft_layers = draft_layers_of(cfg, model) if cfg.speculative == "layer-skip" else 0
    network = draft_network(model, draft_layers, draft, num_blocks, device)
    if mtp is not None:
        network = mtp_network(mtp, groups, num_blocks, device, cfg.num_speculative_tokens)
    runner = ModelRunner(
        model,
        groups,
        num_blocks,
        device,
        cfg.max_num_seqs,
        cfg.seed,
        cpu_threads,
        decode_graphs=not cfg.enforce_eager and cfg.ep_size <= 1,  # EP exchanges vary in size
        after_forward=forward_listener(moe),
        spec_tokens=cfg.num_speculative_tokens if cfg.speculative else 0,
        draft_network=network,
    )
    runner.warm_up()
    # the tier moves' queue takes the demotions of the blocks the KV manager reuses
    queue = _tier_queue(cfg, runner) if cfg.prefix_caching else None
    kv = KVManager(groups, kv_memory, cfg.max_num_seqs, queue.demote if queue else None)
    if kv.paged and kv.capacity_tokens() < max_model_len:
        log.warning(  # such requests are refused with this reason; shorter ones run
            "kv_pool_below_max_model_len",
            kv_capacity_tokens=kv.capacity_tokens(),
            max_model_len=max_model_len,
        )
    prefix = _prefix_cache(cfg, kv, queue, runner, hf_config, dtype) if queue else None
    speculator = build_speculator(cfg, runner, kv, overlap) if cfg.speculative else None
    scheduler = Scheduler(kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, prefix, speculator)
    eos = tokenizer.eos_token_ids if tokenizer else _config_eos(hf_config)
    executor = lockstep_executor(moe, model, runner)
    store = prefix.store if prefix is not None else None
    engine = Engine(
        runner,
        kv,
        scheduler,
        tokenizer,
        eos,
        max_model_len,
        overlap,
        executor,
        prefix=prefix,
        store=store,
        sweeper=_sweeper(cfg, store, prefix.classes) if prefix and store else None,
        sweep_interval_s=cfg.kv_store_gc_interval_s,
        moe=moe,
        observer=metrics,
        handoff_timeout_s=handoff_timeout_s,
        handoff_min_tokens=handoff_min_tokens,
        handoff_store=handoff_store,
        handoff_store_wait_s=handoff_store_wait_s,
        images=image_embeddings(cfg, model, device, hf_config, dtype, remote_images),
    )
    if metrics is not None:
        metrics.collect_engine(engine)
    name = cfg.served_model_name or default_name(cfg, path, hf_config)
    log.info(
        "engine_ready",
        model=name,
        random_weight_demo=is_demo(hf_config),
        kv_blocks=kv.num_blocks,
        kv_capacity_tokens=kv.capacity_tokens(),
        max_model_len=max_model_len,
        overlap=overlap,
        decode_graphs=type(runner.graphs).__name__ if runner.graphs else None,
        host_cache_gb=cfg.host_cache_memory_gb if prefix else 0,
        kv_store=str(prefix.store.dir) if prefix and prefix.store else None,
        speculative=cfg.speculative,
        spec_policy=cfg.spec_policy if cfg.speculative else None,
        draft_layers=draft_layers or None,
        draft_model=cfg.draft_model if draft else None,
    )
    return engine, name


def _tier_queue(cfg: EngineConfig, runner: ModelRunner) -> TierQueue | None:
    """None where the model has no paged KV (no blocks to share, so no prefix cache)."""
    if runner.copier is None:
        return None
    host = HostTier(int(cfg.host_cache_memory_gb * 2**30)) if cfg.host_cache_memory_gb else None
    return TierQueue(host, runner.copier.block_bytes)


def _prefix_cache(
    cfg: EngineConfig, kv: KVManager, queue: TierQueue, runner: ModelRunner, hf_config: dict, dtype
) -> PrefixCache:
    fingerprint = json.dumps(hf_config, sort_keys=True) + str(dtype) + str(kv.prefix_block)
    salt = hashlib.blake2b((KV_LAYOUT + fingerprint).encode(), digest_size=16).digest()
    tiers = dict(classes=TrafficClasses.from_specs(cfg.traffic_classes))
    if cfg.kv_store_dir:
        tiers["store"] = BlockStore(
            Path(cfg.kv_store_dir).expanduser(),
            salt,
            queue.block_bytes,
            fsync=cfg.kv_store_fsync,
            io_threads=cfg.kv_store_io_threads,
            read_timeout_s=cfg.kv_store_read_timeout_s,
        )
    if kv.swa_group is None:
        return PrefixCache(kv, queue, salt, **tiers)
    cache = runner.cache
    swa = SWACache(int(cfg.swa_cache_memory_gb * 2**30), cfg.swa_cache_ttl_s)
    return PrefixCache(
        kv,
        queue,
        salt,
        **tiers,
        swa=swa,
        swa_bytes=cache.swa_snapshot_bytes,
        replay_tokens=(
            cache.cfg.sliding_window if cfg.swa_miss_policy == "window" else cache.replay_tokens
        ),
        policy=cfg.swa_miss_policy,
    )


def _sweeper(cfg: EngineConfig, store: BlockStore, classes: TrafficClasses) -> StoreSweeper:
    capacity = int(cfg.kv_store_capacity_gb * 2**30)
    if not capacity:
        fs = os.statvfs(store.dir) if store.dir.exists() else None
        capacity = fs.f_blocks * fs.f_frsize if fs else 0
    return StoreSweeper(
        store, classes, capacity, cfg.kv_store_high_watermark, cfg.kv_store_low_watermark
    )


def _cpu_threads(cfg: EngineConfig) -> int:
    if cfg.cpu_threads:
        return cfg.cpu_threads
    cores = len(os.sched_getaffinity(0))
    # On a few cores the forward needs them all (a 2-core machine halves its matmul rate
    # with one); on many, one core left to the event loop costs little and hides its work.
    return cores - 1 if cfg.overlap is not False and cores > 4 else cores


def resolve_overlap(cfg: EngineConfig, device: torch.device, cpu_threads: int) -> bool:
    """The configured overlap, or by default: on with an accelerator; on a CPU only where the
    forward leaves a core to the event loop, else the loop's work takes turns with the
    forward's on the same cores (and the GIL) and only slows it (V4 bench model on 2 cores:
    10 % more tok/s without)."""
    if cfg.overlap is not None:
        return cfg.overlap
    return device.type != "cpu" or cpu_threads < len(os.sched_getaffinity(0))


def _config_eos(hf_config: dict) -> tuple[int, ...]:
    value = hf_config.get("eos_token_id")
    return tuple(value) if isinstance(value, list) else () if value is None else (value,)
