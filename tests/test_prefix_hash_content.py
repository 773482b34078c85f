"""Prefix keys over content the token ids only stand for (an image behind its placeholders)."""

from __future__ import annotations

from daemon.kv.prefix_hash import block_hashes

SALT = b"s" * 16


def test_content_changes_only_the_blocks_it_covers_and_after() -> None:
    tokens = list(range(64))  # four blocks of 16
    plain = block_hashes(tokens, 16, SALT, [])
    a = block_hashes(tokens, 16, SALT, [], [(20, 36, b"image-a")])
    b = block_hashes(tokens, 16, SALT, [], [(20, 36, b"image-b")])
    assert a[0] == b[0] == plain[0]  # before the image
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # its blocks, and the chain after
    assert all(x != y for x, y in zip(a[1:], plain[1:]))
    assert block_hashes(tokens, 16, SALT, a[:2], [(20, 36, b"image-a")]) == a  # extending
