"""Prefix-cache keys: a hash chain over token ids, one 128-bit key per full block."""

from __future__ import annotations

import hashlib
from array import array


def block_hashes(tokens: list[int], block: int, salt: bytes, done: list[bytes]) -> list[bytes]:
    """Extend `done` (the keys of the first len(done) blocks) to every full block of `tokens`.

    Key i = blake2b-128(key i-1 | tokens of block i); key -1 is the salt (a model
    fingerprint, plus a tenant's cache_salt), so equal keys mean equal prefixes.
    """
    keys = list(done)
    parent = keys[-1] if keys else salt
    for start in range(len(keys) * block, len(tokens) - block + 1, block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", tokens[start : start + block]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys
