"""A request's images: their sources read (data URLs; other schemes only where the settings
allow them, through deepseek-recipe's fetcher), held to the limits by their bytes and headers,
and decoded and preprocessed by the model's own image processor only where they are encoded."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
import urllib.parse
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.api.codecs.base import CodecError
from daemon.loop.image_input import ImageInput, ImageRejected

if TYPE_CHECKING:
    import torch

SCHEMES = ("data", "http", "https")


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request
    max_bytes: int = 10 * 2**20  # per image, encoded
    max_total_bytes: int = 32 * 2**20  # per request, encoded
    max_pixels: int = 4096 * 4096  # per image, width x height
    schemes: tuple[str, ...] = ("data",)  # URL schemes read; http(s) fetch from the network
    fetch_timeout_s: float = 10.0


@dataclass(frozen=True)
class ImageRef:
    url: str
    param: str  # where the request has it, e.g. messages[0].content[1]


@dataclass(frozen=True)
class ReadImage:
    digest: bytes  # sha256 of the image's bytes
    data: bytes  # the image's bytes
    size: tuple[int, int]  # width, height, from its header


class ImageReader:
    """Reads a request's image references (blocking: in a thread): their bytes, held to the
    limits with their headers (format, size), and their content hash. Their pixels are made
    later, by `input`'s ImageInput, only where an image is encoded (not for one an encoder node
    encodes, nor one whose embeddings are cached).

    The placeholder count per image is the MODEL's (its processor expands one image token into
    `image_tokens`), not deepseek-recipe's image token calculation, which is DeepSeek-V4's."""

    def __init__(
        self, processor: Any, limits: ImageLimits, image_token_id: int, image_tokens: int
    ) -> None:
        self.processor = processor
        self.limits = limits
        self.image_token_id = image_token_id
        self.image_tokens = image_tokens
        self.preprocessed = 0  # images decoded and preprocessed (`pixels`), for /metrics
        self._count = threading.Lock()  # `pixels` runs on worker threads
        self._fetcher: Any = None
        if set(limits.schemes) - {"data"}:  # the network only where the settings allow it
            from deepseek_recipe import ReqwestImageFetcher

            self._fetcher = ReqwestImageFetcher.with_max_bytes(limits.max_bytes)

    @classmethod
    def load(
        cls, model_dir: Path, limits: ImageLimits, image_token_id: int, image_tokens: int
    ) -> ImageReader | None:
        """None where the checkpoint has no image processor (preprocessor_config.json)."""
        if not (model_dir / "preprocessor_config.json").is_file():
            return None
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        return cls(
            CLIPImageProcessorPil.from_pretrained(model_dir), limits, image_token_id, image_tokens
        )

    def check_count(self, refs: list[ImageRef]) -> None:
        if len(refs) > self.limits.max_images:
            raise CodecError(
                f"the request has {len(refs)} images; at most {self.limits.max_images} are allowed",
                refs[self.limits.max_images].param,
            )

    def read(self, refs: list[ImageRef]) -> list[ReadImage]:
        self.check_count(refs)
        total = 0
        out = []
        for ref in refs:
            data = self._bytes(ref)
            total += len(data)
            if total > self.limits.max_total_bytes:
                raise CodecError(
                    f"the request's images exceed {self.limits.max_total_bytes} bytes", ref.param
                )
            size = self._header(data, ref.param)
            out.append(ReadImage(hashlib.sha256(data).digest(), data, size))
        return out

    def check(self, data: bytes, param: str) -> tuple[int, int]:
        """An image's bytes (as an encoder node is sent them) held to the per-image limits by
        their size and header; its width and height. CodecError names `param`."""
        if len(data) > self.limits.max_bytes:
            raise CodecError(
                f"the image has {len(data)} bytes; at most {self.limits.max_bytes} are allowed",
                param,
            )
        return self._header(data, param)

    def pixels(self, data: bytes, param: str) -> torch.Tensor:
        """An image's bytes checked, decoded and preprocessed: [3, H, W]; CodecError names
        `param`."""
        from PIL import Image

        self.check(data, param)
        try:
            image = Image.open(io.BytesIO(data)).convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError):
            raise _undecodable(param) from None
        pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        with self._count:
            self.preprocessed += 1
        return pixels[0].float()

    def input(self, digest: bytes, data: bytes, start: int, param: str) -> ImageInput:
        """The image (checked already) as the engine takes it: its pixels made when called."""
        return ImageInput(digest, start, data, partial(self._rejecting, data, param), param)

    def _rejecting(self, data: bytes, param: str) -> torch.Tensor:
        try:
            return self.pixels(data, param)
        except CodecError as e:  # the engine's kind: the loop knows nothing of codecs
            raise ImageRejected(e.message, param) from None

    def _bytes(self, ref: ImageRef) -> bytes:
        scheme = ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""
        if scheme not in self.limits.schemes:
            allowed = ", ".join(self.limits.schemes)
            raise CodecError(
                f"image URLs with scheme {scheme or '(none)'!r} are not read here "
                f"(allowed: {allowed})",
                ref.param,
            )
        data = _data_url(ref) if scheme == "data" else self._fetch(ref)
        if len(data) > self.limits.max_bytes:
            raise CodecError(
                f"the image has {len(data)} bytes; at most {self.limits.max_bytes} are allowed",
                ref.param,
            )
        return data

    def _fetch(self, ref: ImageRef) -> bytes:
        from deepseek_recipe import ImageError

        try:
            return self._fetcher.fetch(ref.url)
        except ImageError as e:
            raise CodecError(f"the image could not be fetched: {e}", ref.param) from None

    def _header(self, data: bytes, param: str) -> tuple[int, int]:
        """Width and height from the image's header (its pixels are not decoded), within the
        pixel limit."""
        from PIL import Image, UnidentifiedImageError

        try:
            w, h = Image.open(io.BytesIO(data)).size  # reads the header only
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            raise _undecodable(param) from None
        if w * h > self.limits.max_pixels:
            raise CodecError(
                f"the image has {w}x{h} pixels; at most {self.limits.max_pixels} are allowed",
                param,
            )
        return w, h


def _undecodable(param: str) -> CodecError:
    return CodecError("the image could not be decoded (png, jpeg, gif and webp are read)", param)


def _data_url(ref: ImageRef) -> bytes:
    """A data URL's body: base64, or percent-encoded."""
    header, sep, body = ref.url.partition(",")
    if not sep or not header.lower().startswith("data:"):
        raise CodecError("a data URL needs the form data:[<type>][;base64],<data>", ref.param)
    if header.lower().endswith(";base64"):
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise CodecError("the data URL's base64 body is invalid", ref.param) from None
    return urllib.parse.unquote_to_bytes(body)


def chat_image_refs(body: dict[str, Any]) -> list[ImageRef]:
    """The `image_url` parts of Chat Completions messages, in order."""
    refs = []
    messages = body.get("messages")
    if not isinstance(messages, list):
        return refs
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            param = f"messages[{i}].content[{j}].image_url"
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise CodecError("an image_url part needs a 'url' string", param)
            refs.append(ImageRef(url, param))
    return refs


def expand_placeholders(
    ids: list[int], token: int, per_image: int, images: int, param: str = "messages"
) -> tuple[list[int], list[int]]:
    """Each of the prompt's image tokens as `per_image` of them (as the model's processor
    does); returns the ids and each image's first position. The prompt must hold exactly one
    image token per image (text that spells the token is refused)."""
    found = ids.count(token)
    if found != images:
        raise CodecError(
            f"the prompt holds {found} image placeholders for {images} images (the text may "
            "not spell the model's image token)",
            param,
        )
    out: list[int] = []
    starts: list[int] = []
    for t in ids:
        if t == token:
            starts.append(len(out))
            out.extend([token] * per_image)
        else:
            out.append(t)
    return out, starts


def source_refs(sources: list[Any]) -> list[ImageRef]:
    """deepseek-recipe's image sources (Messages `image` blocks, Responses `input_image` parts,
    as its conversion reads them) as references; `param` is the request location it gives."""
    refs = []
    for s in sources:
        if s.kind == "data_url":
            url = s.data_url
        elif s.kind == "url":
            url = s.url
        else:  # encoded bytes: read as a data URL of them
            url = "data:;base64," + base64.b64encode(s.data or b"").decode()
        refs.append(ImageRef(url or "", s.path or "image"))
    return refs
