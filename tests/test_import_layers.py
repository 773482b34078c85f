"""The import rules of pyproject.toml's [tool.importlinter] contracts hold (import-linter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(cli), "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_import_contracts_are_kept() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_contract_breaks_on_an_upward_import(tmp_path: Path) -> None:
    """The check can fail: a stricter layering than ours (kv above loop) is reported broken."""
    config = tmp_path / "upside_down.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["daemon"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "kv above loop"\ntype = "layers"\n'
        'layers = ["daemon.kv", "daemon.loop"]\n'
    )
    result = lint_imports(str(config))
    assert result.returncode != 0
    assert "daemon.loop is not allowed to import daemon.kv" in result.stdout
