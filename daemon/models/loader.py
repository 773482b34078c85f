"""Load a Hugging Face-format checkpoint directory (config.json + *.safetensors), or a GGUF
file, into our models."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from daemon.models.deepseek_v4.config import V4Config
from daemon.models.deepseek_v4.model import DeepseekV4ForCausalLM
from daemon.models.deepseek_v4.weights import describe_part, is_scale, mtp_key, weight_of_scale
from daemon.models.dense import DenseConfig, DenseForCausalLM
from daemon.models.gguf_checkpoint.cache import cache_file, read_into, write_from
from daemon.models.gguf_checkpoint.metadata_cache import kept_config
from daemon.models.gguf_checkpoint.reader import GGUFError, find_gguf, open_gguf
from daemon.models.gguf_checkpoint.weights import hf_tensors
from daemon.models.llava import LlavaConfig, LlavaForConditionalGeneration

log = structlog.get_logger(__name__)

MODEL_TYPES: dict[str, tuple[Any, Any]] = {
    "llama": (DenseConfig, DenseForCausalLM),
    "mistral": (DenseConfig, DenseForCausalLM),
    "qwen2": (DenseConfig, DenseForCausalLM),
    "qwen3": (DenseConfig, DenseForCausalLM),
    "deepseek_v4": (V4Config, DeepseekV4ForCausalLM),
    "llava": (LlavaConfig, LlavaForConditionalGeneration),
}
# the model types of text-only dense models (DenseForCausalLM)
DENSE_TYPES = frozenset(t for t, (_, cls) in MODEL_TYPES.items() if cls is DenseForCausalLM)


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: dict[str, Any]
    dtype: torch.dtype
    path: Path


def read_config(path: Path, gguf_cache: Path | None = None) -> dict[str, Any]:
    """config.json, or the config a GGUF file's metadata makes (`path` names it or a directory
    holding it; kept in `gguf_cache`, where given, for the next start)."""
    with _gguf_errors():
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return kept_config(gguf_file, gguf_cache)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json")
    return json.loads(config_file.read_text())


def checkpoint_dtype(hf_config: dict[str, Any]) -> str | None:
    return hf_config.get("dtype") or hf_config.get("torch_dtype")


def load_model(
    path: str | Path, device: torch.device, dtype: torch.dtype, weight_cache: Path | None = None
) -> LoadedModel:
    """The model at `path` on `device`; `weight_cache`: a directory where a GGUF file's
    dequantized weights are kept between runs (None: dequantize every time)."""
    path = Path(path)
    hf_config = read_config(path, weight_cache)
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise ModelLoadError(f"model_type {model_type!r} is not supported (supported: {supported})")
    config_cls, model_cls = MODEL_TYPES[model_type]
    try:
        cfg = config_cls.from_hf(hf_config)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}/config.json: {e}") from e
    # Built with `dtype` as the default: what a model declares float32 (DeepSeek-V4's norms,
    # hyper-connections, sinks, router bias, position biases) stays float32, as in the reference.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls(cfg, device)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    with _gguf_errors():
        gguf_file = find_gguf(path)
        if gguf_file is None:
            load_weights(model, path, fp8_block_size(hf_config), dtype)
        else:
            load_gguf_weights(model, gguf_file, hf_config, dtype, weight_cache)
    after_load = getattr(model, "after_load", None)
    if after_load is not None:
        after_load()
    model.eval()
    log.info(
        "model_loaded", path=str(path), model_type=model_type, dtype=str(dtype), device=str(device)
    )
    return LoadedModel(model, hf_config, dtype, path)


def load_gguf_weights(
    model: nn.Module,
    gguf_file: Path,
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    weight_cache: Path | None,
) -> None:
    """Fill `model` from `gguf_file`, or from the dequantized copy kept under `weight_cache`
    (written there after a dequantization)."""
    kept = cache_file(weight_cache, gguf_file, dtype) if weight_cache is not None else None
    if kept is not None and read_into(model, kept):
        log.info("weights_from_cache", file=str(kept))
        return
    reader = open_gguf(gguf_file)
    tensors = hf_tensors(reader, hf_config)
    fill_weights(model, tensors, len(reader.tensors), gguf_file.name, "dequantizing GGUF")
    if kept is not None:
        write_from(model, kept)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(hf_config: dict[str, Any]) -> tuple[int, int]:
    """The FP8 scale block of a checkpoint: `quantization_config.weight_block_size`, else
    DeepSeek's 128x128."""
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def load_weights(
    model: nn.Module,
    path: Path,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype | None = None,
) -> None:
    """Fill `model` from the *.safetensors in `path`. FP8 weights are dequantised with their
    block scales; `mtp.*` tensors go to `model.mtp` as stored (dequantised FP8 ones as `dtype`,
    by default the embedding's)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    expected = {(name, part) for name in targets for part in model.param_parts(name)}
    loaded: dict[tuple[str, Any], str] = {}  # part -> the checkpoint tensor that filled it
    handles = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except SafetensorError as e:  # a truncated or damaged file
            raise ModelLoadError(f"{f.name}: {e}") from e
        handles.update({key: (f, handle) for key in handle.keys()})  # noqa: SIM118 (not a dict)
    scales = {
        weight_of_scale(k): k for k in handles if is_scale(k) and not _is_param(model, targets, k)
    }
    orphans = sorted(k for w, k in scales.items() if w not in handles)
    if orphans:
        raise ModelLoadError(
            f"checkpoint {path} has FP8 scales without their weight: {', '.join(orphans[:8])}"
        )
    scale_keys = set(scales.values())
    mtp = getattr(model, "mtp", None)
    like = next((p for p in model.parameters() if p.is_floating_point()), None)
    mtp_dtype = dtype or (like.dtype if like is not None else None)
    with tqdm(total=len(handles), desc="loading weights", unit="tensor", leave=False) as bar:
        for key, (f, handle) in handles.items():
            bar.update(1)
            if key in scale_keys:
                continue  # read with its weight
            target = model.checkpoint_to_param(key)
            if target is None:
                continue
            name, part = target
            tensor = handle.get_tensor(key)
            if key in scales:
                scale = handles[scales[key]][1].get_tensor(scales[key])
                tensor = dequantize_fp8(tensor, scale, block_size, key)
            elif tensor.dtype in FP8_DTYPES:
                raise ModelLoadError(f"{f.name}: FP8 tensor {key!r} has no scale beside it")
            if name.startswith("mtp.") and mtp is not None:
                if key in scales and mtp_dtype is not None:
                    tensor = tensor.to(mtp_dtype)  # dequantised; otherwise as stored
                if like is not None:
                    tensor = tensor.to(device=like.device)
                mtp[mtp_key(name)] = nn.Parameter(tensor, requires_grad=False)
                continue
            _fill_part(model, targets, loaded, name, part, key, tensor, f.name)
    _check_complete(expected, loaded, f"checkpoint {path}")


def fill_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    total: int,
    source: str,
    desc: str = "loading weights",
) -> None:
    """Fill `model` from (checkpoint name, tensor) pairs, `total` of them, read from `source`
    (the GGUF path; safetensors directories go through load_weights)."""
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    expected = {(name, part) for name in targets for part in model.param_parts(name)}
    loaded: dict[tuple[str, Any], str] = {}
    for key, tensor in tqdm(tensors, total=total, desc=desc, unit="tensor", leave=False):
        target = model.checkpoint_to_param(key)
        if target is None:
            continue
        name, part = target
        _fill_part(model, targets, loaded, name, part, key, tensor, source)
    _check_complete(expected, loaded, source)


def _fill_part(
    model: nn.Module,
    targets: dict[str, torch.Tensor],
    loaded: dict[tuple[str, Any], str],
    name: str,
    part: Any,
    key: str,
    tensor: torch.Tensor,
    where: str,
) -> None:
    """Copy checkpoint tensor `key` into part `part` of parameter `name`; two tensors that
    fill the same part are an error."""
    if name not in targets:
        raise ModelLoadError(f"{where}: unexpected tensor {key!r}")
    _copy_into(model.param_view(name, targets[name].data, part), tensor, key)
    for covered in model.covered_parts(name, part):
        if (name, covered) in loaded:
            raise ModelLoadError(
                f"checkpoint tensors {loaded[(name, covered)]!r} and {key!r} both "
                f"fill {_describe(name, covered)}"
            )
        loaded[(name, covered)] = key


def _check_complete(
    expected: set[tuple[str, Any]], loaded: dict[tuple[str, Any], str], what: str
) -> None:
    missing = sorted(_describe(n, p) for n, p in expected - loaded.keys())
    if missing:
        raise ModelLoadError(f"{what} lacks tensors for: {', '.join(missing[:8])}")


@contextmanager
def _gguf_errors() -> Iterator[None]:
    """GGUF problems as ModelLoadError (the one-line startup failure)."""
    try:
        yield
    except GGUFError as e:
        raise ModelLoadError(str(e)) from e


def dequantize_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    key: str = "weight",
) -> torch.Tensor:
    """Block-scaled FP8 to float32: `scale[..., i, j]` multiplies the block of rows
    i*block_size[0].. and columns j*block_size[1].. of `weight[...]` (edge blocks may be
    partial). A one-element scale is per-tensor. Scales may be float32 or UE8M0."""
    if weight.dtype not in FP8_DTYPES:
        raise ModelLoadError(
            f"{key!r} has a scale but dtype {weight.dtype}; only FP8 "
            "(float8_e4m3fn, float8_e5m2) block-scaled weights are supported"
        )
    if scale.numel() == 1:
        return weight.float() * scale.float().reshape(())
    if weight.dim() < 2:
        raise ModelLoadError(f"{key!r} has shape {tuple(weight.shape)}: no blocks to scale")
    rows, cols = weight.shape[-2:]
    br, bc = block_size
    want = (*weight.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(scale.shape) != want:
        raise ModelLoadError(
            f"{key!r} has shape {tuple(weight.shape)} and a scale of shape "
            f"{tuple(scale.shape)}; {br}x{bc} blocks need {want}"
        )
    full = scale.float().repeat_interleave(br, -2)[..., :rows, :]
    full = full.repeat_interleave(bc, -1)[..., :cols]
    return weight.float() * full


def _is_param(model: nn.Module, targets: dict[str, torch.Tensor], key: str) -> bool:
    """A checkpoint name that maps to a model tensor is never an FP8 scale."""
    target = model.checkpoint_to_param(key)
    return target is not None and target[0] in targets


def _describe(name: str, part: Any) -> str:
    if part is None:
        return name
    return f"{name}[{describe_part(part) if isinstance(part, tuple) else part}]"


def _copy_into(target: torch.Tensor, tensor: torch.Tensor, key: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"tensor {key!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor.to(target.dtype))
