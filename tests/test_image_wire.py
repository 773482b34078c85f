"""The encoder role's payloads: images as sent (each checked against its digest) one way,
embeddings (one checked tensor) the other; anything cut, padded or altered is refused."""

from __future__ import annotations

import hashlib

import pytest
import torch

from daemon.cluster.image_wire import (
    EncodedImages,
    ImagePayload,
    PayloadError,
    pack,
    pack_encoded,
    unpack,
    unpack_encoded,
)
from tests.test_api_images import png


def encoded(*images: bytes) -> EncodedImages:
    return EncodedImages(list(images), [hashlib.sha256(i).digest() for i in images], "fp")


def test_encoded_images_round_trip_at_their_own_size() -> None:
    sent = encoded(png(1), png(2, (64, 48)))
    body = pack_encoded(sent)
    assert len(body) < sum(map(len, sent.images)) + 300  # the images as sent, and a header
    assert unpack_encoded(body, 1 << 20) == sent
    assert unpack_encoded(pack_encoded(encoded()), 0) == encoded()


def test_encoded_images_refused_when_altered() -> None:
    body = pack_encoded(encoded(png(1), png(2)))
    flipped = bytearray(body)
    flipped[-1] ^= 1
    cases = [
        (bytes(flipped), "sha256"),
        (body[:-1], "size"),
        (body + b"x", "size"),
        (body[:5], "shorter"),
        (pack(ImagePayload(torch.zeros(1, 2), [b"d"], "fp")), "kind"),  # embeddings, not images
    ]
    for data, words in cases:
        with pytest.raises(PayloadError, match=words):
            unpack_encoded(data, 1 << 20)
    with pytest.raises(PayloadError, match="too large"):
        unpack_encoded(body, 10)
    lying = EncodedImages([png(1)], [hashlib.sha256(png(2)).digest()], "fp")
    with pytest.raises(PayloadError, match="digest"):
        unpack_encoded(pack_encoded(lying), 1 << 20)


def test_embeddings_round_trip() -> None:
    t = torch.randn(2, 3, 4)
    out = unpack(pack(ImagePayload(t, [b"a", b"b"], "fp")), 1 << 20)
    assert torch.equal(out.tensor, t) and out.digests == [b"a", b"b"]
    with pytest.raises(PayloadError, match="kind"):
        unpack(pack_encoded(encoded(png(1))), 1 << 20)
