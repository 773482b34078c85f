"""Assemble an engine from settings: checkpoint, device, KV memory, runner and scheduler."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

import structlog
import torch

from daemon.build.config import EngineConfig
from daemon.build.demo import default_name, is_demo, model_path
from daemon.build.device import resolve_device, resolve_dtype
from daemon.build.moe import forward_listener, lockstep_executor, moe_controller
from daemon.build.mtp import mtp_layer, mtp_network
from daemon.build.mtp import state_bytes as mtp_state_bytes
from daemon.build.paths import compile_cache_dir
from daemon.build.startup import StartupError, failing_as
from daemon.kv.block_store import BlockStore
from daemon.kv.host_tier import HostTier
from daemon.kv.manager import KVBudgetTooSmall, KVManager, pool_sizes
from daemon.kv.prefix import PrefixCache
from daemon.kv.spec import KVGroup
from daemon.kv.store_gc import StoreSweeper
from daemon.kv.swa_cache import SWACache
from daemon.kv.tier_ops import TierQueue
from daemon.kv.traffic import TrafficClasses
from daemon.loop.draft_model import DraftModel
from daemon.loop.early_exit import DraftNetwork, LayerSkip
from daemon.loop.engine import Engine
from daemon.loop.metrics import EngineMetrics
from daemon.loop.runner import ModelRunner
from daemon.loop.scheduler import Scheduler
from daemon.loop.spec.drafters import build_drafter
from daemon.loop.spec.policy import build_policy
from daemon.loop.spec.speculator import Speculator
from daemon.loop.spec.stats import SpecStats
from daemon.loop.spec_profile import profile
from daemon.models.base import EarlyExitModel, Model, ModelCache
from daemon.models.deepseek_v4.mtp import MTPLayer
from daemon.models.gguf_checkpoint.reader import find_gguf
from daemon.models.loader import ModelLoadError, checkpoint_dtype, load_model, read_config
from daemon.models.rope import UnsupportedRope
from daemon.models.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)

KV_LAYOUT = "deepinfer-kv-1"  # bump when a cache's block layout changes: old store files miss


def build_engine(cfg: EngineConfig, metrics: EngineMetrics | None = None) -> tuple[Engine, str]:
    """The engine and the name it serves the model under; `metrics`: its request observer
    (what /metrics serves), None for none. A model, device or KV budget that cannot serve
    raises StartupError."""
    cfg = _implied(cfg)
    with failing_as("model", ModelLoadError, OSError):
        path = model_path(cfg)
        hf_config = read_config(path)
    with failing_as(f"device {cfg.device}", RuntimeError, ValueError):
        device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, checkpoint_dtype(hf_config), device)
    with failing_as(f"model {path}", ModelLoadError, UnsupportedRope, OSError):
        loaded = load_model(path, device, dtype)
    model = loaded.model
    # `tokenizers` raises plain Exceptions; whatever it is, the files cannot serve
    with failing_as(f"tokenizer {find_gguf(path) or path / 'tokenizer.json'}", Exception):
        tokenizer = TextTokenizer.from_dir(path, hf_config)
    max_model_len = min(cfg.max_model_len or model.max_model_len, model.max_model_len)
    if cfg.max_model_len and cfg.max_model_len > max_model_len:
        log.warning("max_model_len_lowered", asked=cfg.max_model_len, model_supports=max_model_len)
    groups = model.kv_groups(dtype, cfg.block_size)
    kv_memory = int(cfg.kv_cache_memory_gb * 2**30)
    draft: tuple[Model, list[KVGroup]] | None = None
    if cfg.speculative == "draft-model":
        draft = _draft_model(cfg, model, groups, tokenizer, device, dtype)
        max_model_len = _bounded_by_draft(draft[0], max_model_len)
        # the draft's cache has as many blocks as the target's: the budget pays for both
        kv_memory = int(kv_memory * _share(groups, draft[1]))
    mtp = _mtp(cfg, model) if cfg.speculative == "mtp" else None
    if mtp is not None:
        kv_memory -= mtp_state_bytes(mtp, cfg.num_speculative_tokens, cfg.max_num_seqs)
    with failing_as("KV cache", KVBudgetTooSmall):
        num_blocks = pool_sizes(groups, kv_memory, cfg.max_num_seqs)
    cpu_threads = _cpu_threads(cfg)
    # inductor's code (the compiled CPU forward) is kept with ours unless told otherwise
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
    overlap = resolve_overlap(cfg, device, cpu_threads)
    # before the runner: it takes the listener, and EP drops others' experts before the KV cache
    moe = moe_controller(cfg, model, device)
    draft_layers = _draft_layers(cfg, model) if cfg.speculative == "layer-skip" else 0
    network = _draft_network(model, draft_layers, draft, num_blocks, device)
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
    speculator = _speculator(cfg, runner, kv, overlap) if cfg.speculative else None
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


def _implied(cfg: EngineConfig) -> EngineConfig:
    """`draft_model` alone turns speculation on with it (as vLLM's draft model path does); any
    other drafter with it, or the draft-model drafter without one, cannot start."""
    if cfg.draft_model and cfg.speculative is None:
        return dataclasses.replace(cfg, speculative="draft-model")
    if cfg.draft_model and cfg.speculative != "draft-model":
        raise StartupError(
            f"draft_model is the draft-model drafter's; speculative is {cfg.speculative!r}"
        )
    if cfg.speculative == "draft-model" and not cfg.draft_model:
        raise StartupError("speculative draft-model: no draft_model (--draft-model PATH) given")
    return cfg


def _draft_model(
    cfg: EngineConfig,
    target: Model,
    groups: list[KVGroup],
    tokenizer: TextTokenizer | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Model, list[KVGroup]]:
    """The draft model (loaded as the target is, in its dtype) and its KV groups, refused unless
    it can draft for `target`: the same tokenizer and vocabulary, and KV the target's block
    tables index (one paged group of the same block size, as a dense target has)."""
    assert cfg.draft_model is not None
    path = Path(cfg.draft_model).expanduser()
    if any(g.spec.per_request for g in groups) or len(groups) != 1:
        raise StartupError(
            "draft model: the target's KV is not one paged group (DeepSeek-V4 keeps "
            "per-request state and blocks of its own geometry); a draft model drafts for dense "
            "targets only"
        )
    with failing_as(f"draft model {path}", ModelLoadError, OSError):
        hf_config = read_config(path)
    with failing_as(
        f"draft model tokenizer {find_gguf(path) or path / 'tokenizer.json'}", Exception
    ):
        draft_tokenizer = TextTokenizer.from_dir(path, hf_config)
    # where either has none, the vocabulary sizes below are all there is to compare
    if tokenizer is not None and draft_tokenizer is not None:
        same = tokenizer.tokenizer.get_vocab() == draft_tokenizer.tokenizer.get_vocab()
        if not same:
            raise StartupError(f"draft model {path}: its tokenizer is not the target's")
    with failing_as(f"draft model {path}", ModelLoadError, UnsupportedRope, OSError):
        draft = load_model(path, device, dtype).model
    if draft.vocab_size != target.vocab_size:
        raise StartupError(
            f"draft model {path}: a vocabulary of {draft.vocab_size} tokens, the target's has "
            f"{target.vocab_size} (a draft model needs the target's tokenizer)"
        )
    draft_groups = draft.kv_groups(dtype, cfg.block_size)
    block = groups[0].spec.block_size
    if len(draft_groups) != 1 or draft_groups[0].spec.per_request:
        raise StartupError(f"draft model {path}: its KV is not one paged group (a dense model's)")
    if draft_groups[0].spec.block_size != block:
        raise StartupError(
            f"draft model {path}: KV blocks of {draft_groups[0].spec.block_size} tokens, the "
            f"target's of {block}"
        )
    return draft, draft_groups


def _bounded_by_draft(draft: Model, max_model_len: int) -> int:
    """The longest request the draft model can follow (its positions), below the target's."""
    if draft.max_model_len < max_model_len:
        log.warning(
            "max_model_len_lowered", asked=max_model_len, draft_model_supports=draft.max_model_len
        )
    return min(max_model_len, draft.max_model_len)


def _share(groups: list[KVGroup], draft_groups: list[KVGroup]) -> float:
    """The target's part of a KV budget that also holds a draft cache of as many blocks."""

    def per_token(gs: list[KVGroup]) -> float:
        return sum(g.spec.bytes_per_block / g.spec.block_size for g in gs)

    target = per_token(groups)
    return target / (target + per_token(draft_groups))


def _draft_network(
    model: Model,
    draft_layers: int,
    draft: tuple[Model, list[KVGroup]] | None,
    num_blocks: list[int],
    device: torch.device,
) -> Callable[[ModelCache], DraftNetwork] | None:
    """What the runner drafts through, made over its cache: the target's first layers, or the
    draft model over a cache of its own with as many blocks as the target's."""
    if draft_layers:
        early = cast(EarlyExitModel, model)
        return lambda cache: LayerSkip(early, cache, draft_layers)
    if draft is not None:
        draft_model, draft_groups = draft
        return lambda cache: DraftModel(
            draft_model, draft_model.allocate_cache(draft_groups, num_blocks, device, 0)
        )
    return None


def _mtp(cfg: EngineConfig, model: Model) -> MTPLayer:
    """`--speculative mtp`: the model's MTP layer (its experts on every rank: no EP)."""
    if cfg.ep_size > 1:
        raise StartupError("speculative mtp: not with expert parallelism (ep_size > 1)")
    return mtp_layer(model)


def _draft_layers(cfg: EngineConfig, model: Model) -> int:
    """The layers that draft with `--speculative layer-skip`: the configured count, or half the
    model's."""
    if not isinstance(model, EarlyExitModel):
        raise StartupError(
            "speculative layer-skip: this model cannot draft from its own first layers (dense "
            "models can; DeepSeek-V4's per-request state would be changed by partial forwards)"
        )
    n = cfg.draft_layers or max(1, model.num_layers // 2)
    if n > model.num_layers:
        raise StartupError(f"draft_layers {n}: the model has {model.num_layers} layers")
    return n


def _speculator(cfg: EngineConfig, runner: ModelRunner, kv: KVManager, overlap: bool) -> Speculator:
    """The drafter and the verify-length policy; the adaptive one weighs drafts against step
    costs measured now, on this device, before any request (logged as a table), and under
    `overlap` against the step each verifying sequence sits out."""
    assert cfg.speculative is not None
    k = cfg.num_speculative_tokens
    cost = None
    if cfg.spec_policy == "adaptive":
        with failing_as("speculative decoding's step-cost profile", ValueError):
            cost = profile(runner, kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, k)
    policy = build_policy(cfg.spec_policy, k, cost, overlap)
    stats = SpecStats(cfg.speculative, cfg.spec_policy)
    return Speculator(build_drafter(cfg.speculative, k), policy, k, stats)


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
