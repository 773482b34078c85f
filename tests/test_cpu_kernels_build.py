"""The C++ CPU kernels' build (kernels/cpu_build.py): a lock left by a build killed midway does
not hang the next process."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kernels import cpu_build
from tests.daemons import ROOT, checkout_env

_LOAD = "from kernels import cpu_build; print('loaded', cpu_build.load())"


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    assert cpu_build.load()  # the built library, to copy (a fresh build takes a minute)
    built = cpu_build.extensions_dir() / "cpu_kernels"
    copy = tmp_path / "extensions" / "cpu_kernels"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "deepinfer.flock"))
    (copy / "lock").touch()  # torch's lock, as a build killed midway leaves it
    done = subprocess.run(
        [sys.executable, "-c", _LOAD],
        cwd=ROOT,
        env=checkout_env() | {"TORCH_EXTENSIONS_DIR": str(copy.parent)},
        capture_output=True,
        text=True,
        timeout=120,  # torch's own wait would never end
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded True" in done.stdout
    assert "cpu_kernels_stale_lock_removed" in done.stderr + done.stdout
    assert not (copy / "lock").exists()


def test_a_header_edit_changes_the_build_flags(tmp_path, monkeypatch) -> None:
    """torch rebuilds on a source or flag change only: the headers' digest is in the flags."""
    (tmp_path / "vec.h").write_text("inline int f() { return 1; }\n")
    monkeypatch.setattr(cpu_build, "SOURCES", tmp_path)
    before = cpu_build.headers_digest()
    assert cpu_build.headers_digest() == before
    (tmp_path / "vec.h").write_text("inline int f() { return 2; }\n")
    assert cpu_build.headers_digest() != before
