"""Issue 23: TTFT of chat requests with images when a unified node encodes them itself vs when
an encoder node (`--role encoder`, named by `--image-encoders`) does, on a random LLaVA (the
tests' tiny one, or a heavier vision tower: `--image-size 224 --vision-hidden 256`). Every
request carries images never sent before (no embedding-cache hit); the two setups are asked
in turn, request by request, medians quoted. `--node-cpus C` gives each daemon a CPU quota
of its own (bench/cpu_quota.py), as if on machines of its own.

    python -m bench.encoder [--requests 12 --images 1 2 --concurrency 1 4 --node-cpus 0.5
        --image-size 224 --vision-hidden 256 --vision-layers 6 --json F]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from bench.autoscale import spawn
from bench.cpu_quota import CpuQuota
from daemon.models.checkpoints import make_llava_checkpoint
from daemon.service.live_server import free_port

NAME = "llava"
IMAGE_TOKEN = 129264  # the DeepSeek tokenizer's <｜image2｜>
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = "Describe each of these pictures in turn, with what is in it and where, please: "


def checkpoint(args, root: Path) -> Path:
    path = make_llava_checkpoint(
        root / "llava", image_token_id=IMAGE_TOKEN, with_tokenizer=True,
        image_size=args.image_size, patch_size=args.patch_size,
        vision_hidden=args.vision_hidden, vision_layers=args.vision_layers,
    )  # fmt: skip
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | {"chat_template": TEMPLATE}))
    return path


def png(seed: int, side: int) -> str:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def ttft(http: aiohttp.ClientSession, url: str, images: list[str]) -> float:
    content = [{"type": "text", "text": TEXT}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in images]
    body = {
        "model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    start = time.monotonic()
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"{url}: {r.status} {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    return time.monotonic() - start
    raise SystemExit(f"{url}: no output")


async def encoded(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("deepinfer:images_encoded"):
                return float(line.split()[1])
    return 0.0


async def measure(args, local: str, remote: str, encoder: str) -> list[dict]:
    seeds = iter(range(1 << 30))
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for n in args.images:
            for c in args.concurrency:
                times: dict[str, list[float]] = {"local": [], "remote": []}
                for i in range(args.requests + 1):  # the first round warms up
                    order = ("local", "remote") if i % 2 == 0 else ("remote", "local")
                    for setup in order:
                        url = local if setup == "local" else remote
                        batch = [[png(next(seeds), args.image_size) for _ in range(n)]
                                 for _ in range(c)]  # fmt: skip
                        got = await asyncio.gather(*(ttft(http, url, b) for b in batch))
                        if i:
                            times[setup].extend(got)
                row = {
                    "images": n, "concurrency": c, "requests": args.requests * c,
                    "local_ttft_p50_s": statistics.median(times["local"]),
                    "remote_ttft_p50_s": statistics.median(times["remote"]),
                }  # fmt: skip
                row["remote_over_local"] = row["remote_ttft_p50_s"] / row["local_ttft_p50_s"]
                out.append(row)
                print(
                    f"{n} image(s), concurrency {c}: TTFT p50 local {row['local_ttft_p50_s']:.3f} s, "
                    f"encoder node {row['remote_ttft_p50_s']:.3f} s "
                    f"({row['remote_over_local']:.2f}x), load {os.getloadavg()[0]:.1f}"
                )
        # the remote node encoded nothing itself; the encoder node did it all
        counts = {u: await encoded(http, u) for u in (local, remote, encoder)}
    print(f"images encoded: local {counts[local]:.0f}, encoder node {counts[encoder]:.0f}")
    return out


async def wait_healthy(urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        for url in urls:
            while True:
                try:
                    async with http.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{url} did not start")
                await asyncio.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=12, help="per setup and point")
    p.add_argument("--images", type=int, nargs="*", default=[1], help="images per request")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1])
    p.add_argument("--node-cpus", type=float, default=0.0, help="a CPU quota per daemon")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--vision-hidden", type=int, default=32)
    p.add_argument("--vision-layers", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-encoder-"))
    model = checkpoint(args, tmp)
    ports = {k: free_port() for k in ("local", "remote", "encoder")}
    url = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    common = [
        "--model", str(model), "--served-model-name", NAME, "--kv-cache-memory-gb", "0.1",
        "--max-num-seqs", "16", "--max-model-len", "1024", "--no-kv-store", "--enforce-eager",
        "--cpu-threads", "1", "--log-format", "json", "--image-max-count", "16",
    ]  # fmt: skip
    extra = {
        "local": [],
        "remote": ["--image-encoders", url["encoder"], "--image-encode-timeout-s", "120"],
        "encoder": ["--role", "encoder"],
    }
    quotas = {k: CpuQuota(f"bench-encoder-{k}", args.node_cpus) if args.node_cpus else None
              for k in ports}  # fmt: skip
    procs = [spawn(ports[k], common + extra[k], tmp / f"{k}.log", quotas[k]) for k in ports]
    try:
        asyncio.run(wait_healthy(list(url.values()), 300))
        rows = asyncio.run(measure(args, url["local"], url["remote"], url["encoder"]))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        for q in quotas.values():
            if q:
                q.remove()
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2))  # fmt: skip
    print(f"logs in {tmp}")


if __name__ == "__main__":
    main()
