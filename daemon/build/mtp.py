"""`--speculative mtp`: DeepSeek-V4's MTP layer as the runner's draft network, built from the
checkpoint's `mtp.*` tensors, its per-request state paid from the KV budget."""

from __future__ import annotations

from collections.abc import Callable

import torch

from daemon.build.startup import StartupError, failing_as
from daemon.kv.spec import KVGroup
from daemon.loop.early_exit import DraftNetwork
from daemon.models.base import Model, ModelCache
from daemon.models.deepseek_v4.model import DeepseekV4ForCausalLM
from daemon.models.deepseek_v4.mtp import MTPCache, MTPDraftNetwork, MTPLayer, build_mtp


def mtp_layer(model: Model) -> MTPLayer:
    """The target's first MTP layer; StartupError where the model has none (not DeepSeek-V4,
    or a checkpoint without `mtp.0.*` tensors) or the checkpoint's cannot be built."""
    if not isinstance(model, DeepseekV4ForCausalLM):
        raise StartupError(
            "speculative mtp: the model has no MTP layers (DeepSeek-V4 checkpoints with mtp.* "
            "tensors only)"
        )
    with failing_as("speculative mtp", ValueError):
        return build_mtp(model)


def state_bytes(layer: MTPLayer, spec_tokens: int, max_num_seqs: int) -> int:
    """The MTP state of every running request (and the scratch row), out of the KV budget."""
    dtype = layer.e_proj.weight.dtype
    return MTPCache.bytes_per_request(layer.cfg, dtype, spec_tokens + 2) * (max_num_seqs + 1)


def mtp_network(
    layer: MTPLayer,
    groups: list[KVGroup],
    num_blocks: list[int],
    device: torch.device,
    spec_tokens: int,
) -> Callable[[ModelCache], DraftNetwork]:
    """The runner's draft network, made once it has allocated the target's cache (the MTP
    state has one row per sliding-window block: the target's block tables index it)."""
    return lambda cache: MTPDraftNetwork.allocate(layer, groups, num_blocks, device, spec_tokens)
