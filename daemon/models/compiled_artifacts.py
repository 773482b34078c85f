"""Compiled graphs saved whole (dynamo's AOT compile: guards, bytecode and inductor's code) beside
inductor's caches, so that a restart loads them without tracing or compiling again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

log = structlog.get_logger(__name__)

FORMAT = 2  # bump when what is saved, or how it is called, changes
# inductor's settings for these graphs: a C++ wrapper calls the kernels of a graph (a Python one
# cost a decode step of SmolLM2-135M at one sequence ~0.4 ms of ~12 over its 30 layers); bf16
# rounded where eager torch rounds it (without, a fused kernel kept fp32 between ops, and over
# SmolLM2's 30 layers the decode layer's hidden states drifted from eager's by up to ~0.5 of
# their largest value, greedy tokens agreeing 38-50 % at 2-64 synthetic rows; with, the same
# tokens and no slower: `bench.cpu_kernels layers`)
INDUCTOR_OPTIONS: dict[str, Any] = {"cpp_wrapper": True, "emulate_precision_casts": True}
# what the graphs' code comes from: any edit there makes new artifacts
_SOURCES = (Path(__file__).parent, Path(__file__).parents[2] / "kernels")
_SUFFIXES = (".py", ".cpp", ".h")
ISA_FILE = "isa_probes.json"  # inductor's vector-ISA probes, as the compile ran them


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
        "inductor": INDUCTOR_OPTIONS,
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
            with path.open("rb") as f, _isa_probes(self._probes(), replay=True):
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
        from torch._inductor import config as inductor_config

        record = self._probes()
        with _isa_probes(record, replay=False), inductor_config.patch(INDUCTOR_OPTIONS):
            compiled = torch.compile(fn, dynamic=False, fullgraph=True).aot_compile((args, {}))
        _probe_again(record)
        path = self.dir / f"{name}.bin"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path))  # written aside, then renamed
            tmp = self.dir / f".{ISA_FILE}.tmp"
            tmp.write_text(json.dumps(record, sort_keys=True))
            tmp.replace(self.dir / ISA_FILE)
        except Exception as e:
            log.warning("compiled_artifact_not_saved", path=str(path), error=_short(e))
        return compiled

    def _probes(self) -> dict[str, bool]:
        """The ISA probes recorded when these graphs were compiled (empty where none are)."""
        try:
            record = json.loads((self.dir / ISA_FILE).read_text())
        except (OSError, ValueError):
            return {}
        ok = isinstance(record, dict) and all(isinstance(v, bool) for v in record.values())
        return record if ok else {}

    def drop(self) -> None:
        """Remove this key's files (they loaded but did not run)."""
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def _isa_probes(record: dict[str, bool], replay: bool) -> Iterator[None]:
    """inductor's vector-ISA probes (each builds a test library and loads it in a child
    Python: ~2 s of a warm start) answered from `record` where `replay` and it holds the
    probe; those it runs are added to it. Keyed by the ISA, its flags and the test code."""
    from torch._inductor.cpu_vec_isa import VecISA

    real = VecISA.check_build

    def check_build(isa: VecISA, code: str) -> bool:
        digest = hashlib.blake2b(code.encode(), digest_size=8).hexdigest()
        key = f"{isa}|{isa.build_arch_flags()}|{digest}"
        if replay and key in record:
            return record[key]
        record[key] = ok = real(isa, code)
        return ok

    VecISA.check_build = check_build
    try:
        yield
    finally:
        VecISA.check_build = real


def _probe_again(record: dict[str, bool]) -> None:
    """Run inductor's ISA probes again into `record`, answering those it holds from it: a
    probe that ran (and was cached) before this compile, for another model or in an earlier
    compile of this process, was not recorded by it, and a new process would run it."""
    from torch._inductor import cpu_vec_isa

    for isa in cpu_vec_isa.supported_vec_isa_list:
        # what a probe found is kept on the ISA (avx512's bf16, AMX's fp16) and changes the
        # flags the probes are keyed by: back to the class's default, as in a new process
        for attr in [a for a in vars(isa) if a.startswith("_is_") and a.endswith("_supported")]:
            delattr(isa, attr)
    for cls in {cpu_vec_isa.VecISA, *map(type, cpu_vec_isa.supported_vec_isa_list)}:
        for cached in cls.__dict__.values():
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    with _isa_probes(record, replay=True):
        cpu_vec_isa.valid_vec_isa_list()


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]
