"""LLaVA (CLIP tower + projector + Llama) against transformers on a tiny random checkpoint: the
image embeddings spliced at the placeholders give transformers' logits, prompt in chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.models.base import SeqSlice
from daemon.models.loader import load_model
from tests.checkpoints import make_llava_checkpoint
from tests.test_models_dense import assert_close_logits

CPU = torch.device("cpu")
BLOCK = 16
IMAGE_TOKEN = 500


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"), image_token_id=IMAGE_TOKEN)


def prompt(n_image: int) -> list[int]:
    """Text, an image's placeholders, text, a second image's, text."""
    return (
        [3, 17, 41] + [IMAGE_TOKEN] * n_image + [99, 7, 250, 31] + [IMAGE_TOKEN] * n_image + [12, 5]
    )


def run_spliced(model, ids: torch.Tensor, embeds: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    (group,) = model.kv_groups(torch.float32, BLOCK)
    num_blocks = -(-len(ids) // BLOCK) + 2
    cache = model.allocate_cache([group], [num_blocks], CPU)
    table = list(range(num_blocks - 1, -1, -1))
    image_rows = (ids == IMAGE_TOKEN).nonzero().flatten()
    out, start = [], 0
    for n in chunks:
        seq = SeqSlice(0, start, n, [table], is_decode=False)
        in_chunk = (image_rows >= start) & (image_rows < start + n)
        rows = image_rows[in_chunk] - start
        with torch.inference_mode():
            hidden = model.forward_spliced(
                ids[start : start + n],
                torch.arange(start, start + n),
                cache.build_attention([seq]),
                cache,
                rows,
                embeds[in_chunk],
            )
            out.append(model.compute_logits(hidden))
        start += n
    return torch.cat(out)


def test_llava_logits_match_transformers(checkpoint: Path) -> None:
    from transformers import LlavaForConditionalGeneration

    ours = load_model(checkpoint, CPU, torch.float32).model
    ref = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert ours.image_tokens == 16
    ids = torch.tensor(prompt(ours.image_tokens))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = ref(input_ids=ids[None], pixel_values=pixels).logits[0]
        embeds = ours.encode_images(pixels)
    assert embeds.shape == (2, 16, 64)
    flat = embeds.reshape(-1, 64)
    # the whole prompt at once, and in chunks that cut the first image in two
    assert_close_logits(run_spliced(ours, ids, flat, [len(ids)]), expected)
    assert_close_logits(run_spliced(ours, ids, flat, [10, 9, len(ids) - 19]), expected)
    # a different image changes the logits from its placeholders on (the test can fail)
    other = run_spliced(ours, ids, flat.flip(0), [len(ids)])
    assert not torch.allclose(other[3:], expected[3:], atol=1e-3)
