"""Image embeddings in the block store: written after an encoding, read on a host miss before
encoding again, so a node started again over the same store (real files) encodes nothing; a
corrupted file is a miss (encoded, written again); an image found there has no pixels made."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from daemon.build.config import EngineConfig
from daemon.build.images import image_embeddings
from daemon.loop.images import ImageEmbeddings
from daemon.models.loader import load_model
from tests.test_images_overlap import prompt_and_image

CPU = torch.device("cpu")


def node(llava_chat_dir: Path, store: Path) -> ImageEmbeddings:
    """A node's embeddings as build_engine makes them (its model, its store)."""
    model = load_model(llava_chat_dir, CPU, torch.float32).model
    hf_config = json.loads((llava_chat_dir / "config.json").read_text())
    cfg = EngineConfig(model=str(llava_chat_dir), kv_store_dir=str(store))
    images = image_embeddings(cfg, model, CPU, hf_config, torch.float32)
    assert images is not None and images.store is not None
    return images


async def test_embeddings_outlive_the_node_in_the_block_store(
    llava_chat_dir: Path, tmp_path: Path
) -> None:
    _, image = prompt_and_image(llava_chat_dir, 21)
    made, pixels = [], image.pixels
    assert pixels is not None
    image = replace(image, pixels=lambda: made.append(1) or pixels())  # counts the pixel work
    first = node(llava_chat_dir, tmp_path)
    spans = await first.spans([image])
    assert (first.stats.encoded, first.stats.store_hits) == (1, 0)
    await first.close()  # its writes flushed
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) == 1

    again = node(llava_chat_dir, tmp_path)  # the node started again: an empty host cache
    found = await again.spans([image])
    assert (again.stats.encoded, again.stats.store_hits) == (0, 1)
    assert len(made) == 1  # found in the store before its pixels were made again
    assert torch.equal(found[0].embeds, spans[0].embeds)
    await again.spans([image])  # now from host memory
    assert (again.stats.encoded, again.stats.store_hits, again.stats.hits) == (0, 1, 1)
    await again.close()

    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF  # the payload's checksum no longer holds
    files[0].write_bytes(bytes(raw))
    third = node(llava_chat_dir, tmp_path)
    fresh = await third.spans([image])
    assert (third.stats.encoded, third.stats.store_hits) == (1, 0)
    assert torch.equal(fresh[0].embeds, spans[0].embeds)
    await third.close()
    assert files[0].read_bytes() != bytes(raw)  # written again, whole
    fourth = node(llava_chat_dir, tmp_path)
    await fourth.spans([image])
    assert (fourth.stats.encoded, fourth.stats.store_hits) == (0, 1)
    await fourth.close()
