"""Codec + HTTP overhead: 1-token chat completions (req/s) and SSE events/s of a long stream
through deepseek-recipe, against /v1/completions with raw token ids on the same model.

    python -m bench.api_overhead [--seconds 10] [--concurrency 8] [--stream-tokens 512]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

from bench.api_common import NAME, cheapest_v4_checkpoint, start_server
from bench.common import machine, quiet_logs

PROMPT_IDS = [0, 128803, 33600, 128804]  # roughly the size of a one-line chat prompt


def chat_body(max_tokens: int, stream: bool) -> dict:
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "thinking": {"type": "disabled"},
        "stream": stream,
    }


def completion_body(max_tokens: int, stream: bool, prompt: list[int]) -> dict:
    return {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def req_per_s(url: str, body: dict, seconds: float, concurrency: int) -> float:
    done = 0
    stop = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop:
            async with session.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            done += 1

    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return done / (time.monotonic() - start)


async def events_per_s(url: str, body: dict, repeats: int = 3) -> tuple[float, int]:
    best, events = 0.0, 0
    async with aiohttp.ClientSession() as session:
        for _ in range(repeats):
            events = 0
            start = time.monotonic()
            async with session.post(url, json=body) as r:
                async for line in r.content:
                    events += line.startswith(b"data: ")
            best = max(best, events / (time.monotonic() - start))
    return best, events


async def main_async(args: argparse.Namespace) -> None:
    model = cheapest_v4_checkpoint()
    server = start_server(model)
    try:
        base = server.base_url
        # the chat prompt of chat_body, as ids, so both endpoints prefill the same length
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                server.url + "/tokenize",
                json={"messages": chat_body(1, False)["messages"]}
                | {"thinking": {"type": "disabled"}},
            ) as r,
        ):
            prompt = (await r.json())["tokens"]
        for _ in range(2):  # warm up
            await req_per_s(base + "/chat/completions", chat_body(1, False), 1, 2)
            await req_per_s(base + "/completions", completion_body(1, False, prompt), 1, 2)
        print(f"machine: {machine()}; prompt {len(prompt)} tokens; {args.concurrency} clients")
        chat = await req_per_s(
            base + "/chat/completions", chat_body(1, False), args.seconds, args.concurrency
        )
        raw = await req_per_s(
            base + "/completions",
            completion_body(1, False, prompt),
            args.seconds,
            args.concurrency,
        )
        print(
            f"1-token requests/s: chat (recipe) {chat:.1f}  completions (ids) {raw:.1f}  "
            f"ratio {chat / raw:.2f}"
        )
        n = args.stream_tokens
        chat_ev, chat_n = await events_per_s(base + "/chat/completions", chat_body(n, True))
        raw_ev, raw_n = await events_per_s(base + "/completions", completion_body(n, True, prompt))
        print(
            f"SSE events/s ({n} tokens): chat (recipe) {chat_ev:.0f} [{chat_n} events]  "
            f"completions (ids) {raw_ev:.0f} [{raw_n} events]  ratio {chat_ev / raw_ev:.2f}"
        )
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=512)
    quiet_logs()
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
