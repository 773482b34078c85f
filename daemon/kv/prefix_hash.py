"""Prefix-cache keys: a hash chain over token ids (and the digests of content the ids only
stand for, such as an image's placeholders), one 128-bit key per full block."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# [start, end) positions whose tokens are placeholders for content of this digest
ContentSpan = tuple[int, int, bytes]


def block_hashes(
    tokens: list[int],
    block: int,
    salt: bytes,
    done: list[bytes],
    content: Sequence[ContentSpan] = (),
) -> list[bytes]:
    """Extend `done` (the keys of the first len(done) blocks) to every full block of `tokens`.

    Key i = blake2b-128(key i-1 | tokens of block i | digests of the `content` spans that
    overlap block i); key -1 is the salt (a model fingerprint, plus a tenant's cache_salt), so
    equal keys mean equal prefixes: two images behind the same placeholder ids differ.
    """
    keys = list(done)
    parent = keys[-1] if keys else salt
    for start in range(len(keys) * block, len(tokens) - block + 1, block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", tokens[start : start + block]).tobytes())
        for first, end, digest in content:
            if first < start + block and end > start:
                h.update(digest)
        parent = h.digest()
        keys.append(parent)
    return keys
