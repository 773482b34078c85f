"""The encoder role on real daemon processes: a node whose images are encoded by an encoder node
(`--role encoder`, found in the node's registry) answers as a single node encoding its own (a
Messages `image` block as a chat `image_url` part); the node never decodes or preprocesses an
image's pixels, the encoder node only those it has no embeddings for; an image the encoder
cannot decode is the node's 400; a dead encoder is passed over for the next; with none left, a
503 in OpenAI's shape, while text-only requests never wait."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from anthropic import Anthropic
from openai import APIStatusError, BadRequestError, OpenAI

from daemon.cluster.image_wire import EncodedImages, pack_encoded
from daemon.service.live_server import free_port
from tests.daemons import spawn, wait_healthy
from tests.test_api_images import (
    NAME,
    base64_block,
    chat_equal,
    data_url,
    message_blocks,
    messages,
    png,
)


def node_args(model: Path, *extra: str) -> list[str]:
    # fmt: off
    return [
        "--model", str(model), "--served-model-name", NAME, "--kv-cache-memory-gb", "0.02",
        "--max-num-seqs", "4", "--max-model-len", "512", "--no-kv-store", "--enforce-eager",
        "--log-format", "json", *extra,
    ]
    # fmt: on


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"deepinfer:{name}_total ") or line.startswith(f"deepinfer:{name} "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_registered(registry: str, url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(registry + "/cluster/v1/nodes?role=encoder", timeout=5) as r:
            if any(n["url"] == url for n in json.loads(r.read())["data"]):
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} did not register as an encoder at {registry}")


def answer(url: str, image: bytes):
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(
        model=NAME,
        messages=messages(data_url(image)),
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    return [(t.token, round(t.logprob, 4)) for t in r.choices[0].logprobs.content]


# Logprobs of two processes on the same embeddings may differ a little: a CI run saw 1.5e-3
# (not reproduced here in 12 runs of this test and 40 schedules of the engine-level one; cause
# not found). One wrong image position moves them by >= 2e-2 (this tiny LLaVA, transformers).
LOGPROB_TOLERANCE = 3e-3


def alike(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> bool:
    """The same tokens, with logprobs within the tolerance."""
    tokens_equal = [t for t, _ in a] == [t for t, _ in b]
    return tokens_equal and all(abs(x - y) <= LOGPROB_TOLERANCE for (_, x), (_, y) in zip(a, b))


def test_remote_encoder_equals_single_node_and_failures_are_clean(llava_chat_dir, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    enc_port, node_port = free_port(), free_port()
    enc, node = f"http://127.0.0.1:{enc_port}", f"http://127.0.0.1:{node_port}"
    # the node is its own registry (a seed peer); the encoder registers there, and is found
    # after the dead one the settings name
    prefill_args = node_args(
        llava_chat_dir,
        *("--image-encoders", dead, "--image-encode-timeout-s", "5", "--peers", node),
    )
    enc_args = node_args(llava_chat_dir, "--role", "encoder", "--peers", node)
    # both start at once: a node asks for its encoders only when an image comes
    proc = spawn(enc_port, enc_args, tmp_path / "enc.log")
    node_proc = spawn(node_port, prefill_args, tmp_path / "node.log")
    try:
        wait_healthy(enc, proc, 120)
        wait_healthy(node, node_proc, 120)
        wait_registered(node, enc)
        image = png(7)
        remote = answer(node, image)  # the dead encoder first, then the live one
        assert metric(node, "images_encoded") == 1  # by the cache's count, remotely
        assert metric(node, "images_preprocessed") == 0  # its pixels are the encoder's work
        assert metric(enc, "images_encoded") == 1
        assert metric(enc, "images_preprocessed") == 1
        single = answer(enc, image)  # the encoder node as a single node: its own tower
        assert metric(enc, "images_encoded") == 1  # found in its cache by content hash
        assert metric(enc, "images_preprocessed") == 1  # looked up before any pixel work
        assert alike(remote, single), (remote, single)
        other = answer(enc, png(8))  # a different image changes the answer
        assert not alike(other, single)
        # sent to the encoder node a second time (the node has not seen it): from its cache
        assert alike(answer(node, png(8)), other)
        assert metric(enc, "images_encoded") == 2
        assert metric(enc, "images_preprocessed") == 2
        # a Messages `image` block goes the same way: to the encoder node, the chat answer
        encoded = metric(enc, "images_encoded")
        claude = Anthropic(base_url=node, api_key="x", max_retries=0, timeout=60)
        blocks = message_blocks(base64_block(png(10)))
        msg = claude.messages.create(
            model=NAME, messages=blocks, max_tokens=4, extra_body={"temperature": 0}
        )
        assert metric(enc, "images_encoded") == encoded + 1
        chat = OpenAI(base_url=node + "/v1", api_key="x", max_retries=0, timeout=60)
        same = chat.chat.completions.create(
            model=NAME, messages=chat_equal(data_url(png(10))), max_tokens=4, temperature=0
        )
        assert msg.content[0].text == same.choices[0].message.content
        # a header that reads but pixels that do not: the encoder's 400, the node's, naming
        # where the request has the image
        with pytest.raises(BadRequestError) as bad:
            chat.chat.completions.create(
                model=NAME, messages=messages(data_url(png(3)[:80])), max_tokens=2
            )
        assert bad.value.body["param"] == "messages[0].content[1].image_url"
        assert "decoded" in bad.value.body["message"]
        assert metric(node, "images_preprocessed") == 0
        # the wire carries the images as sent: one whose digest is not its sha256 is refused
        lying = EncodedImages([png(1)], [hashlib.sha256(png(2)).digest()], "fp")
        post = urllib.request.Request(enc + "/cluster/v1/encode", data=pack_encoded(lying))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10)
        assert refused.value.code == 400 and b"digest" in refused.value.read()
        proc.terminate()
        proc.wait(timeout=15)
        client = OpenAI(base_url=node + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(APIStatusError) as e:
            client.chat.completions.create(
                model=NAME, messages=messages(data_url(png(9))), max_tokens=2
            )
        assert e.value.status_code == 503
        assert "could not be encoded" in e.value.body["message"]
        assert answer(node, image) == remote  # cached here: no encoder needed
        text = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert text.choices[0].finish_reason in ("length", "stop")
    finally:
        for p in (proc, node_proc):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=15)
