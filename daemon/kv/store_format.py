"""On-disk format of one block-store file: a fixed header, then the block payload.

The header carries the format version, the model fingerprint, the block's key, the payload
length and checksum, the traffic class and a checksum of its own; any mismatch makes the
file unusable (a miss), never wrong KV.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"DIKVBLK\0"
VERSION = 1
# magic, version, fingerprint, key, payload length, payload crc32, traffic class, created (unix s)
_FIELDS = struct.Struct("<8sI16s16sQI16sd")
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CRC.size


class BadBlockFile(ValueError):
    """The file exists but cannot be trusted (its reason says why)."""


@dataclass(frozen=True)
class BlockHeader:
    version: int
    fingerprint: bytes
    key: bytes
    payload_len: int
    payload_crc: int
    traffic_class: str
    created: float


def encode_header(
    fingerprint: bytes, key: bytes, payload: memoryview, traffic_class: str, created: float
) -> bytes:
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        fingerprint,
        key,
        payload.nbytes,
        zlib.crc32(payload),
        traffic_class.encode(),
        created,
    )
    return fields + _CRC.pack(zlib.crc32(fields))


def decode_header(raw: bytes | memoryview) -> BlockHeader:
    if len(raw) < HEADER_BYTES:
        raise BadBlockFile("truncated header")
    fields = bytes(raw[: _FIELDS.size])
    (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
    magic, version, fingerprint, key, length, payload_crc, cls, created = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise BadBlockFile("not a block file")
    if zlib.crc32(fields) != crc:
        raise BadBlockFile("header checksum mismatch")
    if version != VERSION:
        raise BadBlockFile(f"format version {version}, expected {VERSION}")
    return BlockHeader(
        version, fingerprint, key, length, payload_crc, cls.rstrip(b"\0").decode(), created
    )


def verify(
    raw: bytes | bytearray | memoryview, fingerprint: bytes, key: bytes, payload_len: int
) -> memoryview:
    """The payload of a whole file's bytes, or BadBlockFile."""
    header = decode_header(raw)
    if header.fingerprint != fingerprint:
        raise BadBlockFile("written for another model or configuration")
    if header.key != key:
        raise BadBlockFile("holds another block")
    if header.payload_len != payload_len or len(raw) != HEADER_BYTES + payload_len:
        raise BadBlockFile(f"length {len(raw) - HEADER_BYTES}, expected {payload_len}")
    payload = memoryview(raw)[HEADER_BYTES:]
    if zlib.crc32(payload) != header.payload_crc:
        raise BadBlockFile("payload checksum mismatch")
    return payload
