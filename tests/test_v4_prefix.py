"""DeepSeek-V4 prefix reuse inside one node: exact resume from cached block state plus the
stored sliding-window state, and the two SWA-miss policies (bounded replay, exact)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from daemon.build import build_engine
from daemon.config import EngineConfig
from daemon.loop.engine import Engine
from daemon.loop.request import SamplingParams
from tests.checkpoints import make_v4_checkpoint

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4"))


async def engine_for(checkpoint: Path, **overrides) -> Engine:
    settings = dict(model=str(checkpoint), kv_cache_memory_gb=0.01, max_num_seqs=4, overlap=True)
    engine, _ = build_engine(EngineConfig(**(settings | overrides)))
    await engine.start()
    return engine


async def turn(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for out in engine.generate(prompt, GREEDY):
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
    return tokens, cached


async def conversation(engine: Engine, forget_swa: bool = False) -> list[tuple[list[int], int]]:
    """Three turns, each prompt extending the previous prompt and answer."""
    g = torch.Generator().manual_seed(11)
    prompt: list[int] = []
    results = []
    for n_new in (37, 11, 20):
        prompt = prompt + torch.randint(2, 512, (n_new,), generator=g).tolist()
        answer, cached = await turn(engine, prompt)
        results.append((answer, cached))
        prompt = prompt + answer
        if forget_swa:
            engine.scheduler.prefix.swa.entries.clear()
    return results


async def test_resume_from_cached_prefix_is_exact(checkpoint: Path) -> None:
    cold = await engine_for(checkpoint, prefix_caching=False)
    warm = await engine_for(checkpoint)
    try:
        expected = await conversation(cold)
        got = await conversation(warm)
    finally:
        await cold.stop()
        await warm.stop()
    assert [a for a, _ in got] == [a for a, _ in expected]
    # turn 2 resumes at the last 8-token boundary of turn 1's 37 + 24 tokens
    assert [c for _, c in got] == [0, 56, 88]
    assert warm.scheduler.prefix.swa.hits == 2


async def test_swa_miss_exact_policy_recomputes(checkpoint: Path) -> None:
    cold = await engine_for(checkpoint, prefix_caching=False)
    exact = await engine_for(checkpoint, swa_miss_policy="exact")
    try:
        expected = await conversation(cold)
        got = await conversation(exact, forget_swa=True)
    finally:
        await cold.stop()
        await exact.stop()
    assert [a for a, _ in got] == [a for a, _ in expected]
    assert [c for _, c in got] == [0, 0, 0]


async def test_swa_miss_bounded_replay(checkpoint: Path) -> None:
    cold = await engine_for(checkpoint, prefix_caching=False)
    replay = await engine_for(checkpoint, swa_miss_policy="replay")
    try:
        expected = await conversation(cold)
        got = await conversation(replay, forget_swa=True)
    finally:
        await cold.stop()
        await replay.stop()
    # the window (8 tokens) before each boundary is recomputed, the blocks before it reused
    assert [c for _, c in got] == [0, 56 - 8, 88 - 8]
    agree = [sum(x == y for x, y in zip(a, b)) / len(a) for (a, _), (b, _) in zip(got, expected)]
    print("greedy agreement per turn", agree)


class TestBoundedReplayDivergence:
    """Bounded replay against the exact state, teacher-forced over 64 tokens (the same
    tokens fed to both, so the comparison isolates the state and not a sampled history).

    Bounds: where the replayed range holds the whole prefix (P <= W) nothing is missing
    and replay must be exact. Beyond it, a random-weight model is a worst case (no
    trained redundancy between the window and the compressed entries), so the bound is
    relative: replay must be far closer to exact than dropping the window altogether.
    Measured at P = 2W (W = 128): mean max-logit delta 1.01 vs 6.23 without a window,
    greedy agreement 72% vs 8%.
    """

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, tmp_path_factory):
        from daemon.models.loader import load_model

        path = make_v4_checkpoint(
            tmp_path_factory.mktemp("v4w128"),
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            sliding_window=128,
            index_topk=16,
        )
        return load_model(path, torch.device("cpu"), torch.float32).model

    @staticmethod
    def compare(model, prefix: int) -> dict[str, dict[str, float]]:
        from daemon.loop.prefix import RestoreOp
        from daemon.models.attention import SeqSlice
        from tests.test_models_v4 import Harness

        tokens = torch.randint(2, 512, (prefix + 64,), generator=torch.Generator().manual_seed(2))
        h = Harness(model, max_seqs=3, blocks=8)
        exact = h.step([(0, tokens, 0)])[0][prefix:]
        results = {}
        for seq, name in ((1, "replay"), (2, "no_window")):
            # a new request on the same cached blocks, with no sliding-window state
            h.tables[seq] = [
                [seq] if g.spec.per_request else h.tables[0][i] for i, g in enumerate(h.groups)
            ]
            h.cache.restore(RestoreOp(prefix, None), h.tables[seq])
            if name == "replay":
                start = prefix - min(128, prefix)
                part = SeqSlice(0, start, prefix - start, h.tables[seq], False, True, start)
                with torch.inference_mode():
                    model(
                        tokens[start:prefix],
                        torch.arange(start, prefix),
                        h.cache.build_attention([part]),
                        h.cache,
                    )
            logits = h.step([(seq, tokens[prefix:], prefix)])[0]
            delta = (logits - exact).abs().max(dim=-1).values
            agree = (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()
            results[name] = {"first": delta[0].item(), "mean": delta.mean().item(), "agree": agree}
        print(f"bounded replay at P={prefix}:", results)
        return results

    def test_exact_when_the_replay_covers_the_prefix(self, model) -> None:
        r = self.compare(model, prefix=128)
        assert r["replay"]["mean"] <= 1e-4 and r["replay"]["agree"] == 1.0

    def test_bounded_beyond_the_window(self, model) -> None:
        r = self.compare(model, prefix=256)
        replay, none = r["replay"], r["no_window"]
        assert replay["mean"] <= 0.3 * none["mean"]
        assert replay["first"] <= 0.3 * none["first"]
        assert replay["agree"] >= 0.6 and replay["agree"] >= none["agree"] + 0.4

    def test_replay_in_a_step_with_other_chunks_equals_alone(self, model) -> None:
        """A replay (its window floor at its start), another request's second prefill chunk
        (part of its window before it) and their continuations in shared steps, padded
        together, give the logits each gets in steps of its own."""
        from daemon.loop.prefix import RestoreOp
        from daemon.models.attention import SeqSlice
        from tests.test_models_v4 import Harness

        g = torch.Generator().manual_seed(8)
        tokens = torch.randint(2, 512, (256 + 24,), generator=g)
        other = torch.randint(2, 512, (45 + 30 + 9,), generator=g)
        replay_start = 256 - 128

        def run(together: bool) -> list[torch.Tensor]:
            h = Harness(model, max_seqs=3, blocks=8)
            h.step([(0, tokens[:256], 0)])
            h.step([(2, other[:45], 0)])
            h.tables[1] = [
                [1] if spec.per_request else h.tables[0][i]
                for i, spec in enumerate(g.spec for g in h.groups)
            ]
            h.cache.restore(RestoreOp(256, None), h.tables[1])
            replay = (
                SeqSlice(0, replay_start, 128, h.tables[1], False, True, replay_start),
                tokens[replay_start:256],
            )
            chunk = (SeqSlice(0, 45, 30, h.tables[2], False), other[45:75])
            for step in [[replay, chunk]] if together else [[replay], [chunk]]:
                slices, row = [], 0
                for part, _ in step:
                    slices.append(replace(part, q_start=row))
                    row += part.num_tokens
                ids = torch.cat([ids for _, ids in step])
                pos = torch.cat([torch.arange(p.start, p.start + p.num_tokens) for p in slices])
                with torch.inference_mode():
                    model(ids, pos, h.cache.build_attention(slices), h.cache)
            parts = [(1, tokens[256:], 256), (2, other[75:], 75)]
            return h.step(parts) if together else h.step(parts[:1]) + h.step(parts[1:])

        alone, together = run(False), run(True)
        for a, t in zip(alone, together):
            assert (a - t).abs().max() <= 1e-4
