"""An encoder node's `POST /cluster/v1/encode`: preprocessed images in, their embeddings out
(the image payload format), through this node's content-hash cache and vision tower."""

from __future__ import annotations

import torch
from aiohttp import web

from daemon.api.http.errors import ApiError, bad_request, unavailable
from daemon.api.http.state import get_state
from daemon.cluster.encoder_client import ENCODE_PATH
from daemon.cluster.image_wire import CONTENT_TYPE, ImagePayload, PayloadError, pack, unpack
from daemon.loop.images import EncoderFailed, ImageInput

MAX_IMAGE_PAYLOAD_BYTES = 256 << 20


async def encode(request: web.Request) -> web.Response:
    state = get_state(request)
    images = state.engine.images
    if images is None:
        raise bad_request("this node's model takes no images")
    try:
        payload = unpack(await request.read(), MAX_IMAGE_PAYLOAD_BYTES)
    except PayloadError as e:
        raise bad_request(f"the image payload is invalid: {e}") from None
    fingerprint = images.fingerprint.hex()
    if payload.fingerprint != fingerprint:
        raise ApiError(409, "the images are for another model", code="fingerprint")
    pixels = payload.tensor
    if pixels.dim() != 4 or pixels.shape[1] != 3 or not pixels.is_floating_point():
        raise bad_request("the images must be a float [images, 3, H, W] tensor")
    state.check_engine()
    inputs = [ImageInput(d, px, 0) for d, px in zip(payload.digests, pixels)]
    try:
        spans = await images.spans(inputs)
    except EncoderFailed as e:
        raise unavailable(f"the images could not be encoded: {e}") from None
    out = torch.stack([s.embeds for s in spans])
    body = pack(ImagePayload(out, payload.digests, fingerprint))
    return web.Response(body=body, content_type=CONTENT_TYPE)


def register(app: web.Application) -> None:
    app.router.add_post(ENCODE_PATH, encode)
