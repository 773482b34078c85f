"""The KV handoff's wire format: a payload reads back as the export it was made of (with the
keys of the full blocks left in the block store), and any altered byte, cut, extra byte or
foreign / stale / late handoff, or stored blocks not asked for or not this prompt's, is
rejected with its reason."""

from __future__ import annotations

import asyncio

import pytest
import torch

from daemon.cluster.wire import (
    Expected,
    HandoffMeta,
    PayloadRejected,
    decode,
    encode,
    prefix_hash,
)
from daemon.loop.handoff import Fetched, HandoffFailed, after_blocks
from daemon.models.base import KVExport, RequestState

PROMPT = list(range(7, 47))
END = len(PROMPT) - 1
BLOCK = 16  # 2 full blocks in [0, END), then a partial one
KEYS = [bytes([i]) * 16 for i in (1, 2)]


def _export() -> KVExport:
    g = torch.Generator().manual_seed(0)
    blocks = {
        0: [torch.randn(3, 16, 2, 8, generator=g), torch.randn(3, 16, 2, 8, generator=g)],
        2: [torch.randn(3, 4, 8, generator=g).to(torch.bfloat16)],
    }
    gate = torch.full((4, 8), float("-inf"))
    state = RequestState(END, [torch.randn(127, 8, generator=g), gate, torch.zeros(0, 8)])
    return KVExport(0, END, blocks, state)


META = HandoffMeta("handoff-1", 3, prefix_hash(PROMPT, END, b"salt"), 2e9, "fp-a")


def _expected(**changes: object) -> Expected:
    fields = dict(
        request_id="handoff-1",
        epoch=3,
        prefix_hash=prefix_hash(PROMPT, END, b"salt"),
        fingerprint="fp-a",
        end=END,
    )
    return Expected(**(fields | changes))


async def _payload(export: KVExport, meta: HandoffMeta = META, stored: int = 0) -> bytes:
    got = Fetched(after_blocks(export, stored, BLOCK), KEYS[:stored])
    return b"".join([bytes(c) async for c in encode(got, meta)])


async def _fetched(data: bytes, expect: Expected) -> Fetched:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await decode(reader, expect)


async def _read(data: bytes, expect: Expected) -> KVExport:
    got = await _fetched(data, expect)
    assert not got.stored
    return got.export


def _reason(data: bytes, expect: Expected | None = None) -> str:
    with pytest.raises(PayloadRejected) as info:
        asyncio.run(_read(data, expect or _expected()))
    assert isinstance(info.value, HandoffFailed)
    return info.value.reason


@pytest.fixture(scope="module")
def payload() -> bytes:
    return asyncio.run(_payload(_export()))


def test_a_payload_reads_back_as_its_export(payload: bytes) -> None:
    got = asyncio.run(_read(payload, _expected()))
    want = _export()
    assert (got.start, got.end, got.state.position) == (0, END, END)
    assert sorted(got.blocks) == [0, 2]
    for group, views in want.blocks.items():
        assert len(got.blocks[group]) == len(views)
        for a, b in zip(got.blocks[group], views):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert len(got.state.tensors) == 3
    for a, b in zip(got.state.tensors, want.state.tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_the_payload_streams_in_bounded_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon.cluster import wire

    monkeypatch.setattr(wire, "CHUNK_BYTES", 1000)

    async def chunks() -> list[int]:
        return [len(c) async for c in encode(Fetched(_export()), META)]

    sizes = asyncio.run(chunks())
    assert max(sizes[1:]) <= 1000 and len(sizes) > 10
    got = asyncio.run(_read(asyncio.run(_payload(_export())), _expected()))
    assert torch.equal(got.blocks[0][1], _export().blocks[0][1])


def test_every_altered_byte_is_rejected(payload: bytes) -> None:
    step = max(1, len(payload) // 150)
    for at in [*range(0, len(payload), step), len(payload) - 1]:
        altered = bytearray(payload)
        altered[at] ^= 0x01
        assert _reason(bytes(altered)) in {
            "checksum", "format", "request_id", "epoch", "fingerprint", "prefix_hash",
            "range", "lease_expired", "too_large", "truncated",
        }, at  # fmt: skip


def test_an_altered_tensor_byte_fails_its_checksum(payload: bytes) -> None:
    altered = bytearray(payload)
    altered[len(payload) // 2] ^= 0x80
    assert _reason(bytes(altered)) == "checksum"


def test_a_cut_payload_is_truncated(payload: bytes) -> None:
    for cut in (0, 3, 20, len(payload) // 2, len(payload) - 1):
        assert _reason(payload[:cut]) == "truncated", cut


def test_bytes_after_the_trailer_are_rejected(payload: bytes) -> None:
    assert _reason(payload + b"x") == "format"


def test_not_a_payload() -> None:
    assert _reason(b'{"error": {"message": "nope"}}' + bytes(64)) == "format"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"request_id": "handoff-2"}, "request_id"),
        ({"epoch": 4}, "epoch"),
        ({"fingerprint": "fp-b"}, "fingerprint"),
        ({"prefix_hash": prefix_hash(PROMPT[::-1], END, b"salt")}, "prefix_hash"),
        ({"prefix_hash": prefix_hash(PROMPT, END, b"other salt")}, "prefix_hash"),
        ({"end": END - 1}, "range"),
        ({"clock": lambda: 2e9 + 1}, "lease_expired"),
        ({"max_bytes": 1000}, "too_large"),
    ],
)
def test_a_payload_of_another_handoff_is_rejected(
    payload: bytes, change: dict, reason: str
) -> None:
    assert _reason(payload, _expected(**change)) == reason


def test_the_prefix_hash_covers_the_positions_and_the_salt() -> None:
    assert prefix_hash(PROMPT, END) == prefix_hash(PROMPT + [1, 2], END)
    assert prefix_hash(PROMPT, END) != prefix_hash(PROMPT, END - 1)
    assert prefix_hash(PROMPT, END) != prefix_hash(PROMPT, END, b"s")


def test_blocks_left_in_the_store_are_named_not_sent() -> None:
    data = asyncio.run(_payload(_export(), stored=2))
    assert len(data) < len(asyncio.run(_payload(_export())))
    got = asyncio.run(_fetched(data, _expected(store_keys=KEYS, block_size=BLOCK)))
    assert got.stored == KEYS
    assert (got.export.start, got.export.end) == (2 * BLOCK, END)
    for a, b in zip(got.export.blocks[0], _export().blocks[0]):
        assert torch.equal(a, b[2:])
    one = asyncio.run(_fetched(asyncio.run(_payload(_export(), stored=1)), _expected(
        store_keys=KEYS, block_size=BLOCK
    )))  # fmt: skip
    assert one.stored == KEYS[:1] and one.export.start == BLOCK
    # offered the store, sent everything: fine
    whole = asyncio.run(_fetched(asyncio.run(_payload(_export())), _expected(
        store_keys=KEYS, block_size=BLOCK
    )))  # fmt: skip
    assert (whole.stored, whole.export.start) == ([], 0)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, "range"),  # the store was not offered
        ({"store_keys": KEYS[:1], "block_size": BLOCK}, "stored"),  # more than offered
        ({"store_keys": KEYS[::-1], "block_size": BLOCK}, "stored"),  # another prompt's
        ({"store_keys": KEYS, "block_size": 8}, "range"),  # another block size
    ],
)
def test_stored_blocks_not_asked_for_are_rejected(change: dict, reason: str) -> None:
    data = asyncio.run(_payload(_export(), stored=2))
    assert _reason(data, _expected(**change)) == reason
