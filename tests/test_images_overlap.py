"""A request's text before its first image prefills while its images encode: the engine stops
at the first placeholder until `images_ready`, then answers exactly as when the embeddings
came first; a prompt whose text is cached up to the image waits unadmitted. (The HTTP path,
which now submits before the images are encoded: tests/test_api_images.py and
tests/test_cluster_encoder.py.)"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.engine import Engine
from daemon.loop.image_input import ImageInput
from daemon.loop.request import Request, RequestStatus, SamplingParams
from tests.test_api_images import image_prompt, png

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)


def prompt_and_image(model: Path, seed: int) -> tuple[list[int], ImageInput]:
    data = png(seed)
    ids, pixels, i = image_prompt(model, data)
    return ids, ImageInput(hashlib.sha256(data).digest(), i, data, lambda: pixels[0])


async def until(check, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def answer(engine: Engine, req: Request) -> list[tuple[int, float]]:
    outs = [out async for out in engine.stream(req)]
    return [(t.token_id, round(t.logprob, 4)) for o in outs for t in o.logprobs or []]


async def test_text_prefills_while_the_images_encode(llava_chat_dir: Path) -> None:
    cfg = EngineConfig(
        model=str(llava_chat_dir), kv_cache_memory_gb=0.02, max_num_seqs=4, max_model_len=512,
        block_size=16, max_num_batched_tokens=16,  # several chunks before the image
    )  # fmt: skip
    engine, _ = build_engine(cfg)
    await engine.start()
    try:
        ids, image = prompt_and_image(llava_chat_dir, 3)
        assert image.start > 16
        req = engine.add_request(ids, GREEDY, "awaiting", awaiting=[image])
        stream = asyncio.ensure_future(answer(engine, req))
        # the text before the image is computed, in chunks, with no embeddings yet
        await until(lambda: req.num_computed == image.start)
        await asyncio.sleep(0.3)
        assert req.num_computed == image.start and not req.finished and not req.images
        spans = await engine.encode_images([image])
        engine.images_ready(req, spans)
        awaited = await asyncio.wait_for(stream, 30)
        # the embeddings given with the request (another cache salt: nothing shared)
        ref = engine.add_request(ids, GREEDY, "given", cache_salt=b"ref", images=spans)
        assert await answer(engine, ref) == awaited and len(awaited) == 4
        # the same prompt again: its blocks up to and past the image are cached, so it may
        # compute nothing before its images come and waits without a slot
        again = engine.add_request(ids, GREEDY, "cached", awaiting=[image])
        stream = asyncio.ensure_future(answer(engine, again))
        await asyncio.sleep(0.3)
        assert again.status is RequestStatus.WAITING and again.slot == -1
        engine.images_ready(again, spans)
        assert await asyncio.wait_for(stream, 30) == awaited
        # a text-only request is not held behind one that waits for its images
        other, image2 = prompt_and_image(llava_chat_dir, 4)
        held = engine.add_request(other, GREEDY, "held", cache_salt=b"x", awaiting=[image2])
        text = engine.add_request(list(range(5, 40)), GREEDY, "text")
        assert len(await asyncio.wait_for(answer(engine, text), 30)) == 4
        assert not held.finished
        # embeddings of another image are refused
        with pytest.raises(ValueError, match="not the images"):
            engine.images_ready(held, spans)
        engine.abort(held.request_id)
    finally:
        await engine.stop()
