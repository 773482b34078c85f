"""The encoder role's payloads: the images as sent (their encoded bytes, each checked against
its content digest) one way; their embeddings the other, one tensor with a JSON header naming
its dtype, shape, sha256 and the images' content digests."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import orjson
import torch

from daemon.cluster.wire import DTYPES

MAGIC = b"DIIM"
ENCODED_MAGIC = b"DIIE"
VERSION = 1
_FRAME = struct.Struct(">4sBI")  # magic, version, header length
MAX_HEADER_BYTES = 1 << 16
CONTENT_TYPE = "application/x-deepinfer-images"
ENCODED_CONTENT_TYPE = "application/x-deepinfer-encoded-images"
_NAMES = {v: k for k, v in DTYPES.items()}


class PayloadError(ValueError):
    """A payload that fails a check: never a tensor."""


@dataclass(frozen=True)
class ImagePayload:
    tensor: torch.Tensor  # [images, ...]
    digests: list[bytes]  # sha256 of each image's bytes
    fingerprint: str  # the model's (vision tower and projector as configured)


@dataclass(frozen=True)
class EncodedImages:
    """Images as sent (png, jpeg, ...), to be decoded and preprocessed by the encoder node."""

    images: list[bytes]
    digests: list[bytes]  # sha256 of each
    fingerprint: str


def pack_encoded(p: EncodedImages) -> bytes:
    header = orjson.dumps(
        {
            "sizes": [len(d) for d in p.images],
            "digests": [d.hex() for d in p.digests],
            "fingerprint": p.fingerprint,
        }
    )
    return b"".join([_FRAME.pack(ENCODED_MAGIC, VERSION, len(header)), header, *p.images])


def unpack_encoded(data: bytes, max_bytes: int) -> EncodedImages:
    """Checked: frame, header, sizes, and each image's sha256 against its digest."""
    header, raw = _frame(data, ENCODED_MAGIC)
    try:
        sizes = [int(n) for n in header["sizes"]]
        digests = [bytes.fromhex(d) for d in header["digests"]]
        fingerprint = str(header["fingerprint"])
    except (KeyError, TypeError, ValueError) as e:
        raise PayloadError(f"the payload's header is invalid: {e}") from None
    if len(sizes) != len(digests) or any(n < 0 for n in sizes):
        raise PayloadError("the payload's sizes do not fit its images")
    if sum(sizes) != len(raw) or len(raw) > max_bytes:
        raise PayloadError("the payload's size does not match its header (or is too large)")
    images, at = [], 0
    for n, digest in zip(sizes, digests):
        image = raw[at : at + n]
        if hashlib.sha256(image).digest() != digest:
            raise PayloadError("an image's sha256 does not match its digest")
        images.append(image)
        at += n
    return EncodedImages(images, digests, fingerprint)


def _frame(data: bytes, magic: bytes) -> tuple[dict, bytes]:
    """The JSON header and what follows it."""
    if len(data) < _FRAME.size:
        raise PayloadError("the payload is shorter than its frame")
    got, version, n = _FRAME.unpack_from(data)
    if got != magic or version != VERSION:
        raise PayloadError("not a payload of this kind and version")
    if n > MAX_HEADER_BYTES or _FRAME.size + n > len(data):
        raise PayloadError("the payload's header is too large or cut short")
    try:
        header = orjson.loads(data[_FRAME.size : _FRAME.size + n])
    except orjson.JSONDecodeError as e:
        raise PayloadError(f"the payload's header is invalid: {e}") from None
    if not isinstance(header, dict):
        raise PayloadError("the payload's header is not an object")
    return header, data[_FRAME.size + n :]


def pack(p: ImagePayload) -> bytes:
    t = p.tensor.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = orjson.dumps(
        {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "nbytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
            "digests": [d.hex() for d in p.digests],
            "fingerprint": p.fingerprint,
        }
    )
    return _FRAME.pack(MAGIC, VERSION, len(header)) + header + raw


def unpack(data: bytes, max_bytes: int) -> ImagePayload:
    """Checked: frame, header fields, size against shape and dtype, the payload's sha256."""
    header, raw = _frame(data, MAGIC)
    try:
        dtype = DTYPES[header["dtype"]]
        shape = [int(s) for s in header["shape"]]
        nbytes, sha = int(header["nbytes"]), str(header["sha256"])
        digests = [bytes.fromhex(d) for d in header["digests"]]
        fingerprint = str(header["fingerprint"])
    except (KeyError, TypeError, ValueError) as e:
        raise PayloadError(f"the payload's header is invalid: {e}") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    if any(s < 0 for s in shape) or not shape or len(digests) != shape[0]:
        raise PayloadError("the payload's shape does not fit its images")
    if nbytes != len(raw) or nbytes != itemsize * _numel(shape) or nbytes > max_bytes:
        raise PayloadError("the payload's size does not match its header (or is too large)")
    if hashlib.sha256(raw).hexdigest() != sha:
        raise PayloadError("the payload's sha256 does not match")
    if not nbytes:
        return ImagePayload(torch.empty(shape, dtype=dtype), digests, fingerprint)
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    return ImagePayload(tensor, digests, fingerprint)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
