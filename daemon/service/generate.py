"""`deepinfer generate`: prompts through the engine as one batch, offline; the outputs printed."""

from __future__ import annotations

import argparse
import asyncio
import time

import structlog

from daemon.build.config import EngineConfig
from daemon.service.flags import add_engine_flags

log = structlog.get_logger(__name__)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="prompt text (repeat for several; they run as one batch)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_flags(p)


async def generate(args: argparse.Namespace, engine_cfg: EngineConfig) -> None:
    from daemon.build.engine import build_engine
    from daemon.loop.request import SamplingParams

    engine, name = build_engine(engine_cfg)
    if engine.tokenizer is None:
        raise SystemExit(f"{name} has no tokenizer.json; generate needs text prompts encoded")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        ignore_eos=args.ignore_eos,
    )
    await engine.start()
    try:
        start = time.monotonic()

        async def run(prompt: str) -> tuple[str, int, str]:
            text, tokens, reason = [], 0, ""
            async for out in engine.generate(engine.tokenizer.encode(prompt), params):
                text.append(out.new_text)
                tokens = out.num_output_tokens
                reason = out.finish_reason.value if out.finish_reason else ""
            return "".join(text), tokens, reason

        results = await asyncio.gather(*(run(p) for p in args.prompt))
        seconds = time.monotonic() - start
    finally:
        await engine.stop()
    for i, (prompt, (text, tokens, reason)) in enumerate(zip(args.prompt, results, strict=True)):
        print(f"--- [{i}] prompt: {prompt!r}  ({tokens} tokens, finish={reason})")
        print(text)
    total = sum(r[1] for r in results)
    log.info(
        "generated",
        model=name,
        prompts=len(results),
        tokens=total,
        seconds=round(seconds, 3),
        tokens_per_s=round(total / max(seconds, 1e-9), 1),
    )
