"""The one checkpoint factory (daemon.models.checkpoints): deterministic, usable by the demo
without transformers, and the benchmarks' only source of checkpoints (they import no tests)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from daemon.models.checkpoints import make_dense_checkpoint, make_v4_checkpoint
from tests.daemons import ROOT, in_checkout


def test_bench_imports_nothing_from_tests() -> None:
    bad = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.name}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert bad == []


def test_same_arguments_same_bytes(tmp_path: Path) -> None:
    for make, kwargs in (
        (make_dense_checkpoint, {"model_type": "qwen3"}),
        (make_v4_checkpoint, {}),
    ):
        a = make(tmp_path / f"{make.__name__}-a", seed=5, **kwargs)
        b = make(tmp_path / f"{make.__name__}-b", seed=5, **kwargs)
        for name in ("config.json", "model.safetensors"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (make.__name__, name)


DEMO_WITHOUT_TRANSFORMERS = """
import json, sys
from pathlib import Path
sys.modules["transformers"] = None  # any import of it now fails
from safetensors import safe_open
from daemon.build.demo import DEMO_CONFIG
from daemon.models.checkpoints import copy_tokenizer, make_own_v4_checkpoint
cfg = DEMO_CONFIG | {"vocab_size": 1024}
path = copy_tokenizer(make_own_v4_checkpoint(Path(sys.argv[1]), cfg))
assert json.loads((path / "config.json").read_text()) == cfg
with safe_open(str(path / "model.safetensors"), "pt") as f:
    assert "model.embed_tokens.weight" in f.keys()
assert (path / "tokenizer.json").is_file()
"""


def test_demo_checkpoint_is_made_without_transformers(tmp_path: Path) -> None:
    proc = in_checkout(
        [sys.executable, "-c", DEMO_WITHOUT_TRANSFORMERS, str(tmp_path)], timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
