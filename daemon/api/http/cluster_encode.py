"""An encoder node's `POST /cluster/v1/encode`: the images as sent in (encoded bytes, each
checked against its digest and held to the limits by its header), their embeddings out (the
image payload format) through this node's content-hash cache; only the images it misses are
decoded and preprocessed here, for the vision tower."""

from __future__ import annotations

import asyncio

import torch
from aiohttp import web

from daemon.api.http.errors import ApiError, bad_request, unavailable
from daemon.api.http.state import get_state
from daemon.cluster.encoder_client import ENCODE_PATH
from daemon.cluster.image_wire import (
    CONTENT_TYPE,
    ImagePayload,
    PayloadError,
    pack,
    unpack_encoded,
)
from daemon.loop.image_input import ImageRejected
from daemon.loop.images import EncoderFailed

MAX_IMAGE_PAYLOAD_BYTES = 256 << 20


async def encode(request: web.Request) -> web.Response:
    state = get_state(request)
    images, reader = state.engine.images, state.codecs.images
    if images is None or reader is None:
        raise bad_request("this node's model takes no images")
    try:
        payload = unpack_encoded(await request.read(), MAX_IMAGE_PAYLOAD_BYTES)
    except PayloadError as e:
        raise bad_request(f"the image payload is invalid: {e}") from None
    fingerprint = images.fingerprint.hex()
    if payload.fingerprint != fingerprint:
        raise ApiError(409, "the images are for another model", code="fingerprint")
    state.check_engine()
    params = [f"images[{i}]" for i in range(len(payload.images))]
    # headers read off the loop; a bad image is a 400 naming its index
    await asyncio.to_thread(
        lambda: [reader.check(data, param) for data, param in zip(payload.images, params)]
    )
    inputs = [
        reader.input(d, data, 0, param)
        for d, data, param in zip(payload.digests, payload.images, params)
    ]
    try:
        spans = await images.spans(inputs)
    except ImageRejected as e:
        raise bad_request(str(e), e.param) from None
    except EncoderFailed as e:
        raise unavailable(f"the images could not be encoded: {e}") from None
    out = torch.stack([s.embeds for s in spans])
    body = pack(ImagePayload(out, payload.digests, fingerprint))
    return web.Response(body=body, content_type=CONTENT_TYPE)


def register(app: web.Application) -> None:
    app.router.add_post(ENCODE_PATH, encode)
