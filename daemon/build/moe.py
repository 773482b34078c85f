"""Wire a MoE model's layers to load statistics and, with `ep_size` > 1, to an expert-parallel
group of daemon processes (gloo on CPU, NCCL on CUDA, HCCL on Ascend)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist
from torch import nn

from daemon.build.config import EngineConfig
from daemon.loop.runner import ModelRunner
from daemon.models.deepseek_v4.blocks import MoE
from daemon.moe.controller import MoEController
from daemon.moe.ep import EPGroup
from daemon.moe.lockstep import LockstepExecutor

log = structlog.get_logger(__name__)

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def moe_controller(
    cfg: EngineConfig, model: nn.Module, device: torch.device
) -> MoEController | None:
    """The MoE controller of the model's MoE layers (None for a dense model); under expert
    parallelism, after joining the group (each rank then keeps only its experts' slots).
    Made before the runner, which reports each forward to it (`forward_listener`)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        if cfg.ep_size > 1:
            raise ValueError("expert parallelism (ep_size > 1) needs a MoE model")
        return None
    ep = join_group(cfg, device) if cfg.ep_size > 1 else None
    return MoEController(
        layers,
        ep,
        cfg.ep_slots_per_rank,
        cfg.moe_stats_interval,
        cfg.moe_rebalance_interval,
        cfg.moe_stats_window,
    )


def forward_listener(controller: MoEController | None) -> Callable[[], None] | None:
    """What the runner calls after each forward: the controller's statistics step. None under
    expert parallelism, where the lockstep executor steps the controller on every rank."""
    if controller is None or controller.ep is not None:
        return None
    return lambda: controller.after_step(controller.schedule())


def lockstep_executor(
    controller: MoEController | None, model: nn.Module, runner: ModelRunner
) -> Executor | None:
    """Under expert parallelism, the lockstep device worker the engine must use (it runs
    `runner.execute` on every rank at once); else None."""
    if controller is None or controller.ep is None:
        return None
    ep = controller.ep
    hidden = model.cfg.hidden_size
    dtype = next(p.dtype for p in model.parameters() if p is not None)

    @torch.inference_mode()
    def idle_step() -> None:
        controller.idle_step(hidden, runner.device, dtype)

    executor = LockstepExecutor(ep, controller, lambda fn: fn == runner.execute, idle_step)
    log.info(
        "expert_parallel",
        rank=ep.rank,
        size=ep.size,
        slots_per_rank=controller.slots_per_rank,
        moe_layers=len(controller.layers),
    )
    return executor


def join_group(cfg: EngineConfig, device: torch.device) -> EPGroup:
    if not 0 <= cfg.ep_rank < cfg.ep_size:
        raise ValueError(f"ep_rank {cfg.ep_rank} is not in [0, {cfg.ep_size})")
    backend = BACKENDS.get(device.type, "gloo")
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{cfg.ep_master}",
            rank=cfg.ep_rank,
            world_size=cfg.ep_size,
            timeout=timedelta(minutes=10),
        )
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return EPGroup(cfg.ep_rank, cfg.ep_size, None, control)
