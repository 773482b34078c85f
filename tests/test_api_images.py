"""Images in Chat Completions on a tiny random LLaVA: greedy output equal to transformers' for the
same image and text, each image preprocessed and encoded once (by content hash, counted in
/metrics), the image in the prefix-cache keys, and the limits and undecodable images as 400s in OpenAI's shape."""

from __future__ import annotations

import base64
import io
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from openai import BadRequestError, OpenAI

from daemon.api.codecs.chat_template import ChatTemplate
from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.models.tokenizer import TextTokenizer
from tests.checkpoints import make_llava_checkpoint

NAME = "tiny-llava"
IMAGE_TOKEN = 129264  # the DeepSeek tokenizer's <｜image2｜>: one special token
IMAGE_TOKENS = 16  # (32 / 8)^2 patches
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# text long enough that the image starts past the first prefix block (16 tokens)
TEXT = "Look at this picture carefully and tell me what you see in it, please: "


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def messages(url: str, text: str = TEXT) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": " Answer."},
            ],
        }
    ]


def make_chat_llava(path: Path) -> Path:
    """The tiny LLaVA with the DeepSeek tokenizer and a plain chat template."""
    make_llava_checkpoint(path, image_token_id=IMAGE_TOKEN, with_tokenizer=True)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | {"chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(llava_chat_dir: Path) -> Iterator[object]:
    from daemon.service.live_server import LiveServer

    s = LiveServer(
        EngineConfig(
            model=str(llava_chat_dir),
            served_model_name=NAME,
            kv_cache_memory_gb=0.05,
            max_num_seqs=8,
            max_model_len=512,
            block_size=16,
        ),
        ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1, image_max_count=2),
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(rf"^deepinfer:{name}(?:_total)? (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def image_prompt(model_dir: Path, image: bytes) -> tuple[list[int], torch.Tensor, int]:
    """The chat prompt of `messages` with the image's placeholders expanded, the image's pixels
    [1, C, H, W] as the model's processor makes them, and the first placeholder's index."""
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = TextTokenizer(model_dir, {})
    template = ChatTemplate.load(model_dir, tok)
    assert template is not None
    ids = template.encode({"messages": messages("x")}, image_text=tok.token_text(IMAGE_TOKEN))
    i = ids.index(IMAGE_TOKEN)
    ids = ids[:i] + [IMAGE_TOKEN] * IMAGE_TOKENS + ids[i + 1 :]
    processor = CLIPImageProcessorPil.from_pretrained(model_dir)
    pixels = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    return ids, pixels["pixel_values"], i


def reference_tokens(llava_chat_dir: Path, image: bytes, n: int) -> list[int]:
    """transformers' greedy tokens for the same prompt and image."""
    from transformers import LlavaForConditionalGeneration

    ids, pixels, _ = image_prompt(llava_chat_dir, image)
    model = LlavaForConditionalGeneration.from_pretrained(
        llava_chat_dir, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=pixels,
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def chat_tokens(client: OpenAI, url: str, n: int = 4):
    r = client.chat.completions.create(
        model=NAME,
        messages=messages(url),
        max_tokens=n,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    return r, [t.token for t in r.choices[0].logprobs.content]


def test_output_equals_transformers_and_image_encoded_once(client, server, llava_chat_dir):
    image = png(1)
    encoded = metric(server, "images_encoded")
    hits = metric(server, "image_cache_hits")
    preprocessed = metric(server, "images_preprocessed")
    first, tokens = chat_tokens(client, data_url(image))
    text_tokens = first.usage.prompt_tokens - IMAGE_TOKENS
    assert first.usage.prompt_tokens == text_tokens + IMAGE_TOKENS
    again, tokens_again = chat_tokens(client, data_url(image))
    assert tokens_again == tokens
    assert metric(server, "images_encoded") == encoded + 1  # the second one from the cache
    assert metric(server, "images_preprocessed") == preprocessed + 1  # its pixels made once
    assert metric(server, "image_cache_hits") == hits + 1
    tok = TextTokenizer(llava_chat_dir, {})
    expected = reference_tokens(llava_chat_dir, image, 4)
    assert tokens == [tok.token_text(t) for t in expected]


def test_different_image_same_text_shares_only_the_text(client, server, llava_chat_dir):
    """Same text, another image: the prefix cache may give only the blocks before the image
    (were the image not in the keys, it would give the image's blocks too: wrong KV)."""
    a, b = png(2), png(3)
    first, tokens_a = chat_tokens(client, data_url(a))
    second, tokens_b = chat_tokens(client, data_url(b))
    tok = TextTokenizer(llava_chat_dir, {})
    template = ChatTemplate.load(llava_chat_dir, tok)
    assert template is not None
    ids = template.encode({"messages": messages("x")}, image_text=tok.token_text(IMAGE_TOKEN))
    image_start = ids.index(IMAGE_TOKEN)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= image_start  # the text before the image, from the cache
    assert cached == image_start // 16 * 16
    assert tokens_b == [tok.token_text(t) for t in reference_tokens(llava_chat_dir, b, 4)]
    again, tokens_again = chat_tokens(client, data_url(a))  # the same image: its blocks found
    assert again.usage.prompt_tokens_details.cached_tokens > image_start
    assert tokens_again == tokens_a


@pytest.mark.parametrize(
    "url, param, words",
    [
        (data_url(b"not an image at all"), "messages[0].content[1].image_url", "decoded"),
        # its header reads, its pixels do not: refused where they are made (the encoding)
        (data_url(png(3)[:80]), "messages[0].content[1].image_url", "decoded"),
        ("data:image/png;base64,@@@", "messages[0].content[1].image_url", "base64"),
        ("http://127.0.0.1:9/x.png", "messages[0].content[1].image_url", "scheme 'http'"),
        ("file:///etc/passwd", "messages[0].content[1].image_url", "scheme 'file'"),
    ],
)
def test_bad_images_are_400s(client, url, param, words):
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=messages(url), max_tokens=2)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err
    assert e.value.response.json()["error"]["type"] == "invalid_request_error"


def test_image_limits_are_400s(client):
    url = data_url(png(4))
    three = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}} for _ in range(3)],
        }
    ]
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=three, max_tokens=2)
    assert "at most 2" in e.value.body["message"]
    assert e.value.body["param"] == "messages[0].content[2].image_url"
    # the text spelling the image token: placeholders that match no image
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "hi <｜image2｜> there"}],
            max_tokens=2,
        )
    assert "placeholders" in e.value.body["message"]
    # text-only requests run as before
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert r.choices[0].finish_reason in ("length", "stop")


GREEDY = {"extra_body": {"temperature": 0}}  # Anthropic's SDK here has no argument for it


def anthropic(server):  # noqa: ANN001, ANN201
    from anthropic import Anthropic

    return Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


def message_blocks(image: dict) -> list[dict]:
    """`messages(...)`'s user turn as Messages content blocks."""
    text = [{"type": "text", "text": TEXT}, image, {"type": "text", "text": " Answer."}]
    return [{"role": "user", "content": text}]


def base64_block(data: bytes, kind: str = "image/png") -> dict:
    source = {"type": "base64", "media_type": kind, "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


def response_input(url: str) -> list[dict]:
    parts = [
        {"type": "input_text", "text": TEXT},
        {"type": "input_image", "image_url": url, "detail": "auto"},
        {"type": "input_text", "text": " Answer."},
    ]
    return [{"role": "user", "content": parts}]


def chat_equal(url: str) -> list[dict]:
    """`message_blocks` and `response_input` as Chat Completions renders the same prompt: the
    recipe joins a turn's parts with a blank line (as DeepSeek's encoding does), chat joins its
    parts as they are."""
    parts = [
        {"type": "text", "text": TEXT + "\n\n"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "\n\n Answer."},
    ]
    return [{"role": "user", "content": parts}]


def test_messages_and_responses_images_answer_as_chat_does(client, server):
    """The same image and text through Anthropic's Messages (a base64 `image` block) and
    OpenAI's Responses (an `input_image` data URL): the chat path's prompt (its length), its
    greedy text, the image encoded once for all three (then from the cache)."""
    image = png(11)
    encoded = metric(server, "images_encoded")
    chat = client.chat.completions.create(
        model=NAME, messages=chat_equal(data_url(image)), max_tokens=6, temperature=0
    )
    msg = anthropic(server).messages.create(
        model=NAME, messages=message_blocks(base64_block(image)), max_tokens=6, **GREEDY
    )
    # Anthropic counts the tokens read from the cache apart (chat's blocks are cached now)
    read = msg.usage.cache_read_input_tokens or 0
    assert read > 0 and msg.usage.input_tokens + read == chat.usage.prompt_tokens
    assert msg.content[0].text == chat.choices[0].message.content
    resp = client.responses.create(
        model=NAME, input=response_input(data_url(image)), max_output_tokens=6, temperature=0
    )
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.output_text == chat.choices[0].message.content
    assert metric(server, "images_encoded") == encoded + 1
    # streamed, the same text
    with anthropic(server).messages.stream(
        model=NAME, messages=message_blocks(base64_block(image)), max_tokens=6, **GREEDY
    ) as stream:
        assert stream.get_final_text() == chat.choices[0].message.content
    events = client.responses.create(
        model=NAME,
        input=response_input(data_url(image)),
        max_output_tokens=6,
        temperature=0,
        stream=True,
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == chat.choices[0].message.content


def test_messages_image_errors_are_anthropic_400s(server):
    from anthropic import BadRequestError as AnthropicBadRequest

    bad = [
        (base64_block(b"not an image at all"), "decoded"),
        ({"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}}, "http"),
    ]
    for block, words in bad:
        with pytest.raises(AnthropicBadRequest) as e:
            anthropic(server).messages.create(
                model=NAME, messages=message_blocks(block), max_tokens=2
            )
        body = e.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert words in body["error"]["message"], body
    three = [{"role": "user", "content": [base64_block(png(4)) for _ in range(3)]}]
    with pytest.raises(AnthropicBadRequest, match="at most 2"):
        anthropic(server).messages.create(model=NAME, messages=three, max_tokens=2)


def test_responses_image_errors_are_openai_400s(client):
    bad = [
        (data_url(b"not an image at all"), "decoded"),
        ("http://127.0.0.1:9/x.png", "scheme 'http'"),
    ]
    for url, words in bad:
        with pytest.raises(BadRequestError) as e:
            client.responses.create(model=NAME, input=response_input(url), max_output_tokens=2)
        err = e.value.response.json()["error"]
        assert err["type"] == "invalid_request_error" and words in err["message"], err
        assert err["param"], err  # where the request has the image
    parts = [{"type": "input_image", "image_url": data_url(png(4))} for _ in range(3)]
    with pytest.raises(BadRequestError, match="at most 2"):
        client.responses.create(
            model=NAME, input=[{"role": "user", "content": parts}], max_output_tokens=2
        )
