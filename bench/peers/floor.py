"""The weight-read floor of a decode step: every weight a token multiplies by, read once, at the
rate this machine copies memory (measured in the same run): no server's TPOT at concurrency 1
gets below it."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import median

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def checkpoint_params(model: Path) -> tuple[int, str]:
    """(elements a token reads: every tensor, less an input embedding that a separate lm_head
    leaves to a one-row lookup; the checkpoint's dtype) from the safetensors headers."""
    shapes: dict[str, int] = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = _numel(meta["shape"])
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors under {model}")
    total = sum(shapes.values())
    if any(n.endswith("lm_head.weight") for n in shapes):
        total -= sum(v for n, v in shapes.items() if n.endswith("embed_tokens.weight"))
    config = json.loads((Path(model) / "config.json").read_text())
    return total, str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def copy_gb_s(nbytes: int, repeats: int = 9) -> float:
    """Median GB/s of `dst.copy_(src)` over `nbytes` (each byte read once and written once),
    on torch's threads as a forward would use them."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / median(times) / 1e9


@dataclass
class Floor:
    copy_gb_s: float  # this machine, measured over the served dtype's weight bytes
    params: int  # elements a token reads
    weight_bytes: dict[str, int]  # by the format a system serves: a dtype, or "gguf"
    tpot_ms: dict[str, float]  # weight_bytes / copy_gb_s, by the same keys

    def for_system(self, system: str, dtype: str) -> float | None:
        """The floor TPOT (ms) of what `system` reads: llama.cpp its GGUF file, the others
        the weights in the served dtype."""
        return self.tpot_ms.get("gguf" if system == "llamacpp" else dtype)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def measure(model: Path | None, gguf: Path | None, dtype: str, repeats: int = 9) -> Floor | None:
    """The floor of the served checkpoint (and the GGUF file, if any), in `dtype` ("auto":
    the checkpoint's dtype, as deepinfer serves an fp32 one) and in fp32; None with neither."""
    formats: dict[str, int] = {}
    params = 0
    if model is not None:
        params, stored = checkpoint_params(model)
        served = stored if dtype == "auto" else dtype
        for name in dict.fromkeys((served, "bfloat16", "float32")):
            formats[name] = params * DTYPE_BYTES[name]
        if dtype == "auto":
            formats["auto"] = formats[served]
    if gguf is not None:
        formats["gguf"] = gguf.stat().st_size  # the tensors, with a few KiB of metadata
    if not formats:
        return None
    size = max(formats.values())
    rate = copy_gb_s(size, repeats)
    tpot = {k: 1e3 * b / (rate * 1e9) for k, b in formats.items()}
    return Floor(rate, params, formats, tpot)
