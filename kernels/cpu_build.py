"""Builds the C++ CPU kernels in kernels/csrc once, through torch's extension loader, and keeps
them under a cache directory (TORCH_EXTENSIONS_DIR, else $DEEPINFER_CACHE/torch-extensions)."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SOURCES = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


def extensions_dir() -> Path:
    """Where built extensions live: TORCH_EXTENSIONS_DIR if set, else under deepinfer's cache."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("DEEPINFER_CACHE", str(Path.home() / ".cache" / "deepinfer"))
    return Path(cache) / "torch-extensions"


@functools.cache
def load(name: str) -> None:
    """Load the operators of csrc/<name>.cpp into torch (compiled on first use, ~30 s; later
    runs load the cached library, which torch rebuilds when the source or flags change)."""
    from torch.utils import cpp_extension

    build = extensions_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cpp_extension.load(
        name=f"deepinfer_{name}",
        sources=[str(SOURCES / f"{name}.cpp")],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    log.info("cpu kernel loaded", kernel=name, seconds=round(time.perf_counter() - started, 2))
