"""Load a Hugging Face-format checkpoint directory (config.json + *.safetensors) into our models."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from daemon.models.deepseek_v4.config import V4Config
from daemon.models.deepseek_v4.model import DeepseekV4ForCausalLM
from daemon.models.deepseek_v4.weights import is_scale, weight_of_scale
from daemon.models.dense import DenseConfig, DenseForCausalLM

log = structlog.get_logger(__name__)

MODEL_TYPES: dict[str, tuple[Any, Any]] = {
    "llama": (DenseConfig, DenseForCausalLM),
    "mistral": (DenseConfig, DenseForCausalLM),
    "qwen2": (DenseConfig, DenseForCausalLM),
    "qwen3": (DenseConfig, DenseForCausalLM),
    "deepseek_v4": (V4Config, DeepseekV4ForCausalLM),
}


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: dict[str, Any]
    dtype: torch.dtype
    path: Path


def read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json")
    return json.loads(config_file.read_text())


def checkpoint_dtype(hf_config: dict[str, Any]) -> str | None:
    return hf_config.get("dtype") or hf_config.get("torch_dtype")


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    path = Path(path)
    hf_config = read_config(path)
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise ModelLoadError(f"model_type {model_type!r} is not supported (supported: {supported})")
    config_cls, model_cls = MODEL_TYPES[model_type]
    try:
        cfg = config_cls.from_hf(hf_config)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}/config.json: {e}") from e
    with torch.device("meta"):
        model = model_cls(cfg, device)
    model.to_empty(device=device)
    model.to(dtype)
    load_weights(model, path)
    model.eval()
    log.info(
        "model_loaded", path=str(path), model_type=model_type, dtype=str(dtype), device=str(device)
    )
    return LoadedModel(model, hf_config, dtype, path)


def load_weights(model: nn.Module, path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    expected = {(name, part) for name in targets for part in model.param_parts(name)}
    loaded: set[tuple[str, Any]] = set()
    handles = {}
    for f in files:
        handle = safe_open(str(f), framework="pt", device="cpu")
        handles.update({key: (f, handle) for key in handle.keys()})  # noqa: SIM118 (not a dict)
    scales = {weight_of_scale(k): k for k in handles if is_scale(k)}
    with tqdm(total=len(handles), desc="loading weights", unit="tensor", leave=False) as bar:
        for key, (f, handle) in handles.items():
            bar.update(1)
            if key in scales.values():
                continue  # read with its weight
            target = model.checkpoint_to_param(key)
            if target is None:
                continue
            name, part = target
            tensor = handle.get_tensor(key)
            if key in scales:
                tensor = dequantize_fp8(tensor, handles[scales[key]][1].get_tensor(scales[key]))
            if name.startswith("mtp.") and hasattr(model, "mtp"):
                model.mtp[name.replace(".", "__")] = nn.Parameter(tensor, requires_grad=False)
                continue
            if name not in targets:
                raise ModelLoadError(f"{f.name}: unexpected tensor {key!r}")
            _copy_into(model.param_view(name, targets[name].data, part), tensor, key)
            loaded.update((name, p) for p in model.covered_parts(name, part))
    missing = sorted(_describe(n, p) for n, p in expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks tensors for: {', '.join(missing[:8])}")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-scaled FP8 (one scale per block, 128x128 in DeepSeek checkpoints) to float32."""
    rows, cols = weight.shape
    block_rows = -(-rows // scale.shape[0])
    block_cols = -(-cols // scale.shape[1])
    full = (
        scale.float()
        .repeat_interleave(block_rows, 0)[:rows]
        .repeat_interleave(block_cols, 1)[:, :cols]
    )
    return weight.float() * full


def _describe(name: str, part: Any) -> str:
    return name if part is None else f"{name}[{part}]"


def _copy_into(target: torch.Tensor, tensor: torch.Tensor, key: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"tensor {key!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor.to(target.dtype))
