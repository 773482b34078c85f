"""The KV handoff's wire format: a request's KVExport and its handoff metadata as a byte stream
(header with a manifest and the keys of the full blocks left in the shared block store, the
tensors, a trailer), and the reader that checks all of it."""

from __future__ import annotations

import asyncio
import hashlib
import math
import struct
import time
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import orjson
import torch

from daemon.loop.handoff import Fetched, HandoffFailed
from daemon.models.base import KVExport, RequestState

MAGIC = b"DIKV"
TRAILER_MAGIC = b"DIKE"
VERSION = 2  # 2: the header names the blocks left in the block store ("stored")
_FRAME = struct.Struct(">4sBI")  # magic, version, header length
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 1 << 14
MAX_PAYLOAD_BYTES = 16 << 30
CHUNK_BYTES = 1 << 20
CONTENT_TYPE = "application/x-deepinfer-kv"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class HandoffMeta:
    """What binds a payload to one handoff: the decode node checks every field."""

    request_id: str
    epoch: int  # the prefill node's epoch
    prefix_hash: str  # `prefix_hash` of the prompt positions the KV covers
    lease_deadline: float  # unix time after which the payload must not be used
    fingerprint: str  # the model fingerprint of the prefill node


def prefix_hash(prompt_ids: list[int], end: int, cache_salt: bytes = b"") -> str:
    """sha256 over the tenant salt and the token ids of positions [0, end)."""
    h = hashlib.sha256(len(cache_salt).to_bytes(4, "big") + cache_salt)
    h.update(end.to_bytes(8, "big"))
    h.update(array("q", prompt_ids[:end]).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class _Tensor:
    name: str  # "blocks.<group>.<view>" or "state.<i>"
    dtype: str
    shape: list[int]
    nbytes: int
    sha256: str


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def _named(export: KVExport) -> list[tuple[str, torch.Tensor]]:
    out = [
        (f"blocks.{group}.{i}", t)
        for group, views in export.blocks.items()
        for i, t in enumerate(views)
    ]
    return out + [(f"state.{i}", t) for i, t in enumerate(export.state.tensors)]


def _manifest(named: list[tuple[str, torch.Tensor]]) -> tuple[list[_Tensor], list[memoryview]]:
    entries, raws = [], []
    for name, t in named:
        if t.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no wire name")
        raw = _raw(t)
        entries.append(
            _Tensor(
                name, _NAMES[t.dtype], list(t.shape), raw.nbytes, hashlib.sha256(raw).hexdigest()
            )
        )
        raws.append(raw)
    return entries, raws


async def encode(got: Fetched, meta: HandoffMeta) -> AsyncIterator[bytes | memoryview]:
    """The payload's byte chunks: frame + JSON header, each tensor's bytes (in chunks of at
    most CHUNK_BYTES), then the trailer (sha256 of everything before it)."""
    export = got.export
    entries, raws = await asyncio.to_thread(_manifest, _named(export))
    header = orjson.dumps(
        {
            "request_id": meta.request_id,
            "epoch": meta.epoch,
            "prefix_hash": meta.prefix_hash,
            "lease_deadline": meta.lease_deadline,
            "fingerprint": meta.fingerprint,
            "start": export.start,
            "end": export.end,
            "position": export.state.position,
            "stored": [k.hex() for k in got.stored],
            "tensors": [e.__dict__ for e in entries],
        }
    )
    whole = hashlib.sha256()
    head = _FRAME.pack(MAGIC, VERSION, len(header)) + header
    whole.update(head)
    yield head
    for raw in raws:
        for at in range(0, raw.nbytes, CHUNK_BYTES):
            chunk = raw[at : at + CHUNK_BYTES]
            whole.update(chunk)
            yield chunk
    yield TRAILER_MAGIC + whole.digest()


class ByteReader(Protocol):
    """What `decode` reads from: aiohttp's StreamReader (a response's `content`) is one."""

    async def readexactly(self, n: int) -> bytes: ...

    async def read(self, n: int = -1) -> bytes: ...


@dataclass(frozen=True)
class Expected:
    """What the decode node expects of a payload."""

    request_id: str
    epoch: int
    prefix_hash: str
    fingerprint: str
    end: int  # the positions the KV must cover: [0, end)
    max_bytes: int = MAX_PAYLOAD_BYTES
    clock: Callable[[], float] = time.time
    # the keys of the full blocks of [0, end) the payload may leave in the block store (a
    # leading part of them) and the block size; none: the payload must hold all of [0, end)
    store_keys: list[bytes] = field(default_factory=list)
    block_size: int = 0


class PayloadRejected(HandoffFailed):
    """A payload that failed a check; `reason` names which (truncated, checksum, epoch, ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def fail(reason: str, detail: str) -> PayloadRejected:
    return PayloadRejected(reason, detail)


async def decode(reader: ByteReader, expect: Expected) -> Fetched:
    """Reads and checks a whole payload; HandoffFailed (with a `reason`) for anything short,
    malformed, altered or not this handoff's. Nothing is returned before the trailer checks."""
    whole = hashlib.sha256()
    frame = await _read(reader, _FRAME.size, whole)
    magic, version, length = _FRAME.unpack(frame)
    if magic != MAGIC or version != VERSION:
        raise fail("format", f"not a version {VERSION} KV payload")
    if length > MAX_HEADER_BYTES:
        raise fail("too_large", f"header of {length} bytes")
    header = _header(await _read(reader, length, whole))
    _check_meta(header, expect)
    stored = _stored(header, expect)
    entries = _entries(header["tensors"], expect.max_bytes)
    tensors: dict[str, torch.Tensor] = {}
    for e in entries:
        tensors[e.name] = await _tensor(reader, e, whole)
    trailer = await _read(reader, len(TRAILER_MAGIC) + 32, None)
    if trailer[:4] != TRAILER_MAGIC or trailer[4:] != whole.digest():
        raise fail("checksum", "the trailer's digest does not match the payload")
    if await reader.read(1):
        raise fail("format", "bytes after the trailer")
    if expect.clock() > header["lease_deadline"]:  # checked last: the read took time
        raise fail("lease_expired", "the handoff's lease ran out")
    return Fetched(_export(header, entries, tensors), stored)


async def _read(reader: ByteReader, n: int, whole: hashlib._Hash | None) -> bytes:
    try:
        data = await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise fail("truncated", f"the payload ended {n - len(e.partial)} bytes short") from None
    if whole is not None:
        whole.update(data)
    return data


def _header(raw: bytes) -> dict:
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise fail("format", "the header is not JSON") from None
    kinds = {
        "request_id": str,
        "epoch": int,
        "prefix_hash": str,
        "lease_deadline": (int, float),
        "fingerprint": str,
        "start": int,
        "end": int,
        "position": int,
        "stored": list,
        "tensors": list,
    }
    if not isinstance(header, dict):
        raise fail("format", "the header is not an object")
    for key, kind in kinds.items():
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise fail("format", f"header field {key!r} missing or of the wrong type")
    return header


def _check_meta(header: dict, expect: Expected) -> None:
    if header["request_id"] != expect.request_id:
        raise fail("request_id", f"payload for {header['request_id']!r}")
    if header["fingerprint"] != expect.fingerprint:
        raise fail("fingerprint", "the prefill node serves another model")
    if header["epoch"] != expect.epoch:
        raise fail("epoch", f"payload of epoch {header['epoch']}, expected {expect.epoch}")
    if header["prefix_hash"] != expect.prefix_hash:
        raise fail("prefix_hash", "the KV is of another prompt")
    start = len(header["stored"]) * expect.block_size
    if header["start"] != start or header["end"] != expect.end or header["position"] != expect.end:
        raise fail(
            "range",
            f"KV of [{header['start']}, {header['end']}), expected [{start}, {expect.end})",
        )
    if expect.clock() > header["lease_deadline"]:
        raise fail("lease_expired", "the handoff's lease ran out")


def _stored(header: dict, expect: Expected) -> list[bytes]:
    """The stored blocks' keys: the first of those the decode node offered the store for."""
    raw = header["stored"]
    if len(raw) > len(expect.store_keys):
        raise fail(
            "stored", f"{len(raw)} blocks left in the store, at most {len(expect.store_keys)}"
        )
    if [k.hex() for k in expect.store_keys[: len(raw)]] != raw:
        raise fail("stored", "the stored blocks are not this prompt's")
    return expect.store_keys[: len(raw)]


def _entries(raw: list, max_bytes: int) -> list[_Tensor]:
    if len(raw) > MAX_TENSORS:
        raise fail("too_large", f"{len(raw)} tensors")
    entries, total, names = [], 0, set()
    for d in raw:
        try:
            e = _Tensor(d["name"], d["dtype"], d["shape"], d["nbytes"], d["sha256"])
        except (KeyError, TypeError):
            raise fail("format", "a manifest entry lacks a field") from None
        if (
            not isinstance(e.name, str)
            or e.name in names
            or not _valid_name(e.name)
            or e.dtype not in DTYPES
            or not isinstance(e.shape, list)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in e.shape)
            or not isinstance(e.sha256, str)
        ):
            raise fail("format", f"manifest entry {d.get('name')!r} is not valid")
        itemsize = torch.empty((), dtype=DTYPES[e.dtype]).element_size()
        if e.nbytes != math.prod(e.shape) * itemsize:
            raise fail("format", f"{e.name}: {e.nbytes} bytes for shape {e.shape}")
        names.add(e.name)
        total += e.nbytes
        if total > max_bytes:
            raise fail("too_large", f"more than {max_bytes} bytes of tensors")
        entries.append(e)
    return entries


def _valid_name(name: str) -> bool:
    parts = name.split(".")
    if parts[0] == "blocks":
        return len(parts) == 3 and all(p.isdigit() for p in parts[1:])
    return parts[0] == "state" and len(parts) == 2 and parts[1].isdigit()


async def _tensor(reader: ByteReader, e: _Tensor, whole: hashlib._Hash) -> torch.Tensor:
    buf = bytearray(e.nbytes)
    h = hashlib.sha256()
    at = 0
    while at < e.nbytes:
        chunk = await _read(reader, min(CHUNK_BYTES, e.nbytes - at), whole)
        buf[at : at + len(chunk)] = chunk
        h.update(chunk)
        at += len(chunk)
    if h.hexdigest() != e.sha256:
        raise fail("checksum", f"{e.name}: the bytes do not match the manifest's sha256")
    dtype = DTYPES[e.dtype]
    if not e.nbytes:
        return torch.empty(e.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(e.shape)


def _export(header: dict, entries: list[_Tensor], tensors: dict[str, torch.Tensor]) -> KVExport:
    """The tensors back in KVExport's order (groups, then views; state tensors by index)."""
    blocks: dict[int, list[torch.Tensor]] = {}
    state: list[tuple[int, torch.Tensor]] = []
    for e in entries:
        parts = e.name.split(".")
        if parts[0] == "blocks":
            blocks.setdefault(int(parts[1]), []).append(tensors[e.name])
            if int(parts[2]) != len(blocks[int(parts[1])]) - 1:
                raise fail("format", f"{e.name} out of order")
        else:
            state.append((int(parts[1]), tensors[e.name]))
    if [i for i, _ in state] != list(range(len(state))):
        raise fail("format", "state tensors out of order")
    return KVExport(
        header["start"],
        header["end"],
        blocks,
        RequestState(header["position"], [t for _, t in state]),
    )
