"""Compiled graphs saved whole (dynamo's AOT compile: guards, bytecode and inductor's code) beside
inductor's caches, so that a restart loads them without tracing or compiling again."""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

log = structlog.get_logger(__name__)

FORMAT = 1  # bump when what is saved, or how it is called, changes
# what the graphs' code comes from: any edit there makes new artifacts
_SOURCES = (Path(__file__).parent, Path(__file__).parents[2] / "kernels")
_SUFFIXES = (".py", ".cpp", ".h")


def artifacts_root() -> Path:
    """Beside inductor's caches (TORCHINDUCTOR_CACHE_DIR; the engine puts it under deepinfer's
    cache directory), whose compiled C++ the artifacts' code loads."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "deepinfer-aot"


def _sources_digest() -> str:
    h = hashlib.blake2b(digest_size=16)
    for root in _SOURCES:
        for path in sorted(p for p in root.rglob("*") if p.suffix in _SUFFIXES):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _settings(module: nn.Module) -> dict[str, Any]:
    """Every plain attribute of `module` and its submodules (eps, scales, head counts...),
    which dynamo bakes into the graph as constants, and its tensors' shapes and dtypes."""
    out: dict[str, Any] = {}
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if not attr.startswith("_") and isinstance(value, (bool, int, float, str, tuple)):
                out[f"{name}.{attr}"] = repr(value)
        out[f"{name}:type"] = type(sub).__qualname__
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        out[name] = [list(t.shape), str(t.dtype)]
    return out


def artifact_key(layer: nn.Module, inputs: dict[str, Any]) -> str:
    """The name under which a layer's graphs are saved: its settings and weights' shapes,
    `inputs` (dtypes, KV layout, anything else the graphs depend on), the code of the models
    and kernels, torch, Python, the CPU's vector ISA and the thread count (inductor's C++
    bakes it in)."""
    fingerprint = {
        "format": FORMAT,
        "layer": _settings(layer),
        "inputs": inputs,
        "sources": _sources_digest(),
        "torch": torch.__version__,
        "python": sys.version,
        "machine": platform.machine(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class CompiledArtifacts:
    """The graphs of one key under `root/key/NAME.bin`; a file that cannot be loaded (corrupt,
    from another torch) is removed and its graph compiled again."""

    def __init__(self, root: Path, key: str) -> None:
        self.dir = root / key

    def load(self, name: str) -> Callable[..., Any] | None:
        """The saved graph `name`, ready to call; None where there is none that loads."""
        path = self.dir / f"{name}.bin"
        if not path.is_file():
            return None
        try:
            with path.open("rb") as f:
                return torch.compiler.load_compiled_function(f)
        except Exception as e:  # unpickling, a version check, a missing op: anything
            log.warning("compiled_artifact_unusable", path=str(path), error=_short(e))
            path.unlink(missing_ok=True)
            return None

    def compile(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> Callable[..., Any]:
        """`fn` compiled whole (fullgraph) for `args` (dims marked dynamic stay so), then
        saved; a save that fails only logs."""
        compiled = torch.compile(fn, dynamic=False, fullgraph=True).aot_compile((args, {}))
        path = self.dir / f"{name}.bin"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path))  # written aside, then renamed
        except Exception as e:
            log.warning("compiled_artifact_not_saved", path=str(path), error=_short(e))
        return compiled

    def drop(self) -> None:
        """Remove this key's files (they loaded but did not run)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]
