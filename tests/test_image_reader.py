"""ImageReader without a server: data URLs, the limits (count, bytes, pixels), undecodable
bytes, and http URLs read from the network only where the schemes allow it."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
import torch

from daemon.api.codecs.base import CodecError
from daemon.api.codecs.images import ImageLimits, ImageReader, ImageRef, expand_placeholders
from daemon.loop.image_input import ImageRejected
from daemon.models.checkpoints import LLAVA_IMAGE_SIZE
from tests.test_api_images import data_url, png


def reader(**limits) -> ImageReader:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    size = LLAVA_IMAGE_SIZE
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    return ImageReader(processor, ImageLimits(**limits), image_token_id=7, image_tokens=4)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """Serves png(5) at /x.png on 127.0.0.1 (404 elsewhere)."""
    body = png(5)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/x.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/x.png"
    server.shutdown()


def test_data_urls_read_and_hashed() -> None:
    a, b = reader().read([ImageRef(data_url(png(1)), "p0"), ImageRef(data_url(png(2)), "p1")])
    assert a.data == png(1) and a.size == (40, 30)  # from the header: no pixels made yet
    # its pixels, made only where it is encoded (an encoder node's way: the bytes as sent)
    image = reader().input(a.digest, a.data, 5, "p0")
    assert (image.start, image.param) == (5, "p0")
    assert image.pixels is not None
    assert image.pixels().shape == (3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE)
    assert torch.equal(reader().pixels(a.data, "images[0]"), image.pixels())
    with pytest.raises(CodecError, match="could not be decoded") as e:
        reader().pixels(b"GIF89a broken", "images[1]")
    assert e.value.param == "images[1]"
    # a header that reads but pixels that do not: refused when its pixels are made
    (cut,) = reader().read([ImageRef(data_url(png(3)[:80]), "p2")])
    pixels = reader().input(cut.digest, cut.data, 0, "p2").pixels
    assert pixels is not None
    with pytest.raises(ImageRejected, match="could not be decoded") as rejected:
        pixels()
    assert rejected.value.param == "p2"
    with pytest.raises(CodecError, match="at most 100"):
        reader(max_bytes=100).pixels(a.data, "images[0]")
    assert a.digest != b.digest
    (again,) = reader().read([ImageRef(data_url(png(1), "image/jpeg"), "p")])  # type not trusted
    assert again.digest == a.digest


@pytest.mark.parametrize(
    "limits, refs, words",
    [
        (dict(max_images=1), [data_url(png(1))] * 2, "at most 1 are allowed"),
        (dict(max_bytes=100), [data_url(png(1))], "bytes; at most 100"),
        (dict(max_total_bytes=len(png(1)) + 10), [data_url(png(1))] * 2, "exceed"),
        (dict(max_pixels=40 * 30 - 1), [data_url(png(1))], "40x30 pixels"),
        ({}, [data_url(b"GIF89a broken")], "could not be decoded"),
        ({}, ["data:image/png,%89PNG%00"], "could not be decoded"),
        ({}, ["data:image/png;base64"], "data:[<type>]"),
    ],
)
def test_limits_and_bad_images(limits, refs, words) -> None:
    with pytest.raises(CodecError) as e:
        reader(**limits).read([ImageRef(u, f"p{i}") for i, u in enumerate(refs)])
    assert words in e.value.message
    assert e.value.param is not None and e.value.param.startswith("p")


def test_http_only_where_allowed(image_server: str) -> None:
    with pytest.raises(CodecError, match="scheme 'http'"):
        reader().read([ImageRef(image_server, "p")])
    (fetched,) = reader(schemes=("data", "http")).read([ImageRef(image_server, "p")])
    (local,) = reader().read([ImageRef(data_url(png(5)), "p")])
    assert fetched.digest == local.digest
    with pytest.raises(CodecError, match="could not be fetched"):
        reader(schemes=("http",)).read([ImageRef(image_server.replace("x.png", "y"), "p")])


def test_placeholders_expand_per_image() -> None:
    ids, starts = expand_placeholders([1, 7, 2, 7, 3], 7, 3, 2)
    assert ids == [1, 7, 7, 7, 2, 7, 7, 7, 3] and starts == [1, 5]
    with pytest.raises(CodecError, match="2 image placeholders for 1 images"):
        expand_placeholders([1, 7, 2, 7], 7, 3, 1)
