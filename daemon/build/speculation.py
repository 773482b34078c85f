"""Speculative decoding's parts of an engine: the drafter's network (layer skipping, a draft
model, DeepSeek-V4's MTP layer), the checks that refuse what cannot draft, and the Speculator."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import cast

import structlog
import torch

from daemon.build.config import EngineConfig
from daemon.build.mtp import mtp_layer
from daemon.build.paths import gguf_cache
from daemon.build.startup import StartupError, failing_as
from daemon.kv.manager import KVManager
from daemon.kv.spec import KVGroup
from daemon.loop.draft_model import DraftModel
from daemon.loop.early_exit import DraftNetwork, LayerSkip
from daemon.loop.runner import ModelRunner
from daemon.loop.spec.drafters import build_drafter
from daemon.loop.spec.policy import build_policy
from daemon.loop.spec.speculator import Speculator
from daemon.loop.spec.stats import SpecStats
from daemon.loop.spec_profile import profile
from daemon.models.base import EarlyExitModel, Model, ModelCache
from daemon.models.deepseek_v4.mtp import MTPLayer
from daemon.models.gguf_checkpoint.reader import find_gguf
from daemon.models.loader import ModelLoadError, load_model, read_config
from daemon.models.rope import UnsupportedRope
from daemon.models.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)


def implied(cfg: EngineConfig) -> EngineConfig:
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


def load_draft_model(
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
        hf_config = read_config(path, gguf_cache(cfg))
    with failing_as(
        f"draft model tokenizer {find_gguf(path) or path / 'tokenizer.json'}", Exception
    ):
        draft_tokenizer = TextTokenizer.from_dir(path, hf_config, gguf_cache(cfg))
    # where either has none, the vocabulary sizes below are all there is to compare
    if tokenizer is not None and draft_tokenizer is not None:
        same = tokenizer.tokenizer.get_vocab() == draft_tokenizer.tokenizer.get_vocab()
        if not same:
            raise StartupError(f"draft model {path}: its tokenizer is not the target's")
    with failing_as(f"draft model {path}", ModelLoadError, UnsupportedRope, OSError):
        draft = load_model(path, device, dtype, gguf_cache(cfg)).model
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


def bounded_by_draft(draft: Model, max_model_len: int) -> int:
    """The longest request the draft model can follow (its positions), below the target's."""
    if draft.max_model_len < max_model_len:
        log.warning(
            "max_model_len_lowered", asked=max_model_len, draft_model_supports=draft.max_model_len
        )
    return min(max_model_len, draft.max_model_len)


def target_share(groups: list[KVGroup], draft_groups: list[KVGroup]) -> float:
    """The target's part of a KV budget that also holds a draft cache of as many blocks."""

    def per_token(gs: list[KVGroup]) -> float:
        return sum(g.spec.bytes_per_block / g.spec.block_size for g in gs)

    target = per_token(groups)
    return target / (target + per_token(draft_groups))


def draft_network(
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


def mtp_for(cfg: EngineConfig, model: Model) -> MTPLayer:
    """`--speculative mtp`: the model's MTP layer (its experts on every rank: no EP)."""
    if cfg.ep_size > 1:
        raise StartupError("speculative mtp: not with expert parallelism (ep_size > 1)")
    return mtp_layer(model)


def draft_layers_of(cfg: EngineConfig, model: Model) -> int:
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


def build_speculator(
    cfg: EngineConfig, runner: ModelRunner, kv: KVManager, overlap: bool
) -> Speculator:
    """The drafter and the verify-length policy; the adaptive one weighs drafts against step
    costs measured now, on this device, before any request (logged as a table), and under
    `overlap` against the step each verifying sequence sits out (the others decode it)."""
    assert cfg.speculative is not None
    k = cfg.num_speculative_tokens
    cost = None
    if cfg.spec_policy == "adaptive":
        with failing_as("speculative decoding's step-cost profile", ValueError):
            cost = profile(runner, kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, k)
    policy = build_policy(cfg.spec_policy, k, cost, overlap, cfg.spec_min_gain)
    stats = SpecStats(cfg.speculative, cfg.spec_policy)
    return Speculator(build_drafter(cfg.speculative, k), policy, k, stats)
