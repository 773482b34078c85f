"""Constrained decoding overhead: output tok/s of a batch of requests with and without a JSON
schema (xgrammar bitmask per row per step), on the engine directly.

    python -m bench.api_constrained [--batch 32] [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from bench.api_common import CHEAPEST_V4, cheapest_v4_checkpoint
from bench.common import machine, quiet_logs
from daemon.api.codecs.constraints import Constraints
from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.constraint import GrammarConstraint
from daemon.loop.engine import Engine
from daemon.loop.request import SamplingParams

# A schema a random model can keep writing for the whole run: a list of free strings.
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}},
    "required": ["items"],
}


async def run_batch(engine: Engine, batch: int, max_tokens: int, compiled) -> tuple[float, int]:
    prompt = list(range(100, 120))

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if compiled is not None:
            params.constraint = GrammarConstraint(compiled)
        n = 0
        async for out in engine.generate(prompt, params):
            n += len(out.new_token_ids)
        return n

    start = time.monotonic()
    counts = await asyncio.gather(*(one(i) for i in range(batch)))
    return sum(counts) / (time.monotonic() - start), sum(counts)


async def main_async(args: argparse.Namespace) -> None:
    model = cheapest_v4_checkpoint()
    engine, _ = build_engine(
        EngineConfig(
            model=str(model),
            kv_cache_memory_gb=0.5,
            max_num_seqs=args.batch,
            max_model_len=4096,
            prefix_caching=False,
        )
    )
    await engine.start()
    try:
        constraints = Constraints(engine.tokenizer, engine.runner.vocab_size, engine.eos_token_ids)
        compiled = await constraints.compile("json", json.dumps(SCHEMA))
        await run_batch(engine, args.batch, 8, None)  # warm up
        await run_batch(engine, args.batch, 8, compiled)
        free, constrained = [], []
        for _ in range(args.repeats):
            free.append((await run_batch(engine, args.batch, args.max_tokens, None))[0])
            constrained.append((await run_batch(engine, args.batch, args.max_tokens, compiled))[0])
        f, c = max(free), max(constrained)
        print(
            f"machine: {machine()}; model {CHEAPEST_V4}; batch {args.batch}, "
            f"{args.max_tokens} tokens each, best of {args.repeats}"
        )
        print(
            f"tok/s unconstrained {f:.0f}  json-schema {c:.0f}  slowdown {100 * (1 - c / f):.1f}%"
        )
        constraints.close()
    finally:
        await engine.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    quiet_logs()
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
