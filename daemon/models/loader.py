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

from daemon.models.dense import DenseConfig, DenseForCausalLM

log = structlog.get_logger(__name__)

MODEL_TYPES: dict[str, tuple[Any, Any]] = {
    "llama": (DenseConfig, DenseForCausalLM),
    "mistral": (DenseConfig, DenseForCausalLM),
    "qwen2": (DenseConfig, DenseForCausalLM),
    "qwen3": (DenseConfig, DenseForCausalLM),
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
    params = dict(model.named_parameters())
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        sizes = model.shard_sizes(name)
        expected.update((name, s) for s in (range(len(sizes)) if sizes else [None]))
    loaded: set[tuple[str, int | None]] = set()
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(total=total, desc="loading weights", unit="tensor", leave=False) as bar:
        for f, handle in zip(files, handles):
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                bar.update(1)
                target = model.checkpoint_to_param(key)
                if target is None:
                    continue
                name, shard = target
                if name not in params:
                    raise ModelLoadError(f"{f.name}: unexpected tensor {key!r}")
                _copy_into(model, params[name], name, shard, handle.get_tensor(key), key)
                loaded.add((name, shard))
    missing = sorted(f"{n}" + ("" if s is None else f"[{s}]") for n, s in expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks tensors for: {', '.join(missing[:8])}")


def _copy_into(
    model: nn.Module,
    param: nn.Parameter,
    name: str,
    shard: int | None,
    tensor: torch.Tensor,
    key: str,
) -> None:
    target = param.data
    if shard is not None:
        sizes = model.shard_sizes(name)
        assert sizes is not None
        offset = sum(sizes[:shard])
        target = target.narrow(0, offset, sizes[shard])
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"tensor {key!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor.to(target.dtype))
