"""Model fingerprints: equal for the same model and KV layout, different when the config, the
weights, the tokenizer or the layout differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from daemon.cluster.fingerprint import kv_layout, model_fingerprint
from daemon.kv.spec import FullAttentionSpec, KVGroup
from daemon.models.checkpoints import make_dense_checkpoint
from daemon.models.loader import read_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    a = make_dense_checkpoint(tmp_path_factory.mktemp("fp-a"), seed=0)
    b = make_dense_checkpoint(tmp_path_factory.mktemp("fp-b"), seed=1)  # same shapes
    return a, b


def _layout(block_size: int = 16, dtype: torch.dtype = torch.float32) -> list[str]:
    spec = FullAttentionSpec(
        block_size=block_size, num_layers=2, dtype=dtype, num_kv_heads=2, head_dim=16
    )
    return kv_layout([KVGroup(spec, (0, 1))])


def _fp(path: Path, layout: list[str] | None = None) -> str:
    return model_fingerprint(path, read_config(path), layout or _layout())


def test_same_model_same_fingerprint(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = checkpoints
    copy = shutil.copytree(a, tmp_path / "elsewhere")
    assert _fp(a) == _fp(copy) and len(_fp(a)) == 64


def test_what_changes_it(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = checkpoints
    base = _fp(a)
    assert _fp(b) != base  # same config and file sizes, other weights
    assert _fp(a, _layout(block_size=32)) != base
    assert _fp(a, _layout(dtype=torch.bfloat16)) != base
    changed = shutil.copytree(a, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps(config | {"rope_theta": 1234.0}))
    assert _fp(changed) != base
    (changed / "config.json").write_text(json.dumps(config, indent=4))  # same config, reformatted
    assert _fp(changed) == base
    (changed / "tokenizer_config.json").write_text("{}")
    assert _fp(changed) != base
