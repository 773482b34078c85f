"""One image of a prompt as the API layer hands it to the engine, and the error for an image that
can never be encoded: no torch here, so the command line and the codecs load without it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt. Its pixels are made (decoded, preprocessed) only by the encoder
    that encodes it on its own tower, after the caches missed: never for an image sent to an
    encoder node, nor for one whose embeddings are cached."""

    digest: bytes  # sha256 of the image's bytes
    start: int  # prompt position of its first placeholder token
    data: bytes = b""  # the image as sent (encoded): what an encoder node is given
    pixels: Callable[[], torch.Tensor] | None = None  # [3, H, W]; raises ImageRejected
    param: str = "image"  # where the request has it


class ImageRejected(ValueError):
    """An image that can never be encoded (undecodable): the request's fault, not the
    encoder's."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
