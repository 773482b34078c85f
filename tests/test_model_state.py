"""Per-request state operations of both model families' caches (models/base.py ModelCache):
a snapshot and restore undo the steps between them (speculative rollback), and a request's KV
exported from one cache and imported into another continues there as on the first
(prefill/decode transfer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.models.base import KVExport, Model, ModelCache, SeqSlice, SlidingWindowCache
from daemon.models.checkpoints import make_dense_checkpoint, make_v4_checkpoint
from daemon.models.deepseek_v4.model import DeepseekV4ForCausalLM
from daemon.models.loader import load_model

CPU = torch.device("cpu")
BLOCK = 16  # the dense paged block size (V4 has its own geometry)


class Harness:
    """A model's own cache for a few sequences, driven step by step (no engine). Sequence i's
    blocks are its own range of the pools, in reverse, offset by `shift` (another cache
    allocates other blocks)."""

    def __init__(self, model, max_seqs: int = 2, blocks: int = 16, shift: int = 0) -> None:
        self.model = model
        groups = model.kv_groups(torch.float32, BLOCK)
        total = blocks * max_seqs + shift
        num = [max_seqs + shift if g.spec.per_request else total for g in groups]
        self.cache = model.allocate_cache(groups, num, CPU)
        self.tables = [
            [
                [i + shift]
                if g.spec.per_request
                else list(range(shift + i * blocks, shift + (i + 1) * blocks))[::-1]
                for g in groups
            ]
            for i in range(max_seqs)
        ]

    def step(self, seq: int, tokens: list[int], start: int) -> torch.Tensor:
        """One step of `tokens` at positions from `start`: their logits."""
        n = len(tokens)
        slices = [SeqSlice(0, start, n, self.tables[seq], n == 1 and start > 0)]
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(tokens),
                torch.arange(start, start + n),
                self.cache.build_attention(slices),
                self.cache,
            )
            return self.model.compute_logits(hidden)

    def decode(self, seq: int, tokens: list[int], start: int) -> torch.Tensor:
        """`tokens` one step each from position `start`: the logits of every step."""
        return torch.cat([self.step(seq, [t], start + i) for i, t in enumerate(tokens)])


@pytest.fixture(scope="module", params=["llama", "deepseek_v4"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        make_dense_checkpoint(path, "llama")
    else:
        make_v4_checkpoint(path)
    return load_model(Path(path), CPU, torch.float32).model


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_rollback_then_decode_equals_a_straight_run(model) -> None:
    """Draft tokens verified as one chunk, then rejected: after a restore to the snapshot the
    true tokens decode exactly as without the drafts. The drafts close compressor windows and
    overwrite ring rows the window still needs (V4); dense models keep no such state."""
    prompt, true, drafts = _ids(37, 1), _ids(12, 2), _ids(11, 3)
    p = len(prompt)
    straight = Harness(model)
    straight.step(0, prompt, 0)
    expected = straight.decode(0, true, p)

    h = Harness(model)
    h.step(0, prompt, 0)
    snap = h.cache.snapshot(h.tables[0], p)
    assert snap.position == p
    h.step(0, drafts, p)
    h.decode(0, drafts[:3], p + len(drafts))  # and a few decodes past them
    h.cache.restore_state(snap, h.tables[0])
    assert torch.equal(h.decode(0, true, p), expected)


def test_exported_kv_continues_on_another_cache(model) -> None:
    """Prefill on cache A, export, import into fresh blocks of cache B (whose blocks and
    per-request rows another request used before): the next tokens' logits match A's."""
    prompt, following = _ids(37, 4), _ids(6, 5)
    a = Harness(model)
    a.step(0, prompt, 0)
    export = a.cache.export_kv(a.tables[0], 0, len(prompt))
    assert isinstance(export, KVExport) and (export.start, export.end) == (0, len(prompt))
    tensors = [t for rows in export.blocks.values() for t in rows] + export.state.tensors
    assert tensors and all(t.device.type == "cpu" for t in tensors)

    b = Harness(model, shift=3)
    b.step(1, _ids(45, 6), 0)  # leaves its KV and state in the blocks the import reuses
    b.cache.import_kv(export, b.tables[1])
    got = b.decode(1, following, len(prompt))
    want = a.decode(0, following, len(prompt))
    assert torch.equal(got, want)


def test_export_needs_a_block_aligned_start(model) -> None:
    h = Harness(model)
    h.step(0, _ids(20, 7), 0)
    with pytest.raises(ValueError, match="block size"):
        h.cache.export_kv(h.tables[0], 3, 20)


def _members(protocol: type) -> set[str]:
    return {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def test_models_and_caches_have_the_whole_interface(model) -> None:
    cache = Harness(model).cache
    wanted = [(Model, model), (ModelCache, cache)]
    if isinstance(model, DeepseekV4ForCausalLM):  # the sliding-window family
        wanted.append((SlidingWindowCache, cache))
    for protocol, obj in wanted:
        assert _members(protocol) and not [n for n in _members(protocol) if not hasattr(obj, n)]
