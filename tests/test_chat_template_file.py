"""A checkpoint as current transformers saves it, chat template in chat_template.jinja, answers
/v1/chat/completions; the prompt it renders is transformers' apply_chat_template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from daemon.api.codecs.chat_template import ChatTemplate
from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.models.tokenizer import TextTokenizer
from tests.checkpoints import make_dense_checkpoint
from tests.conftest import LiveServer

NAME = "tiny-jinja-chat"
# ChatML with a default system message, as SmolLM2 and Qwen2.5 ship it
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
STALE = "{{ 'the tokenizer_config.json entry, which the file overrides' }}"
CHATS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
]


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    path = make_dense_checkpoint(
        tmp_path_factory.mktemp("tiny-jinja"), with_tokenizer=True, max_position_embeddings=2048
    )
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def client(saved_dir: Path) -> Iterator[OpenAI]:
    s = LiveServer(
        EngineConfig(
            model=str(saved_dir),
            served_model_name=NAME,
            kv_cache_memory_gb=0.05,
            max_num_seqs=4,
            max_model_len=1024,
        ),
        ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1),
    )
    s.start()
    yield OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
    s.stop()


def test_transformers_saves_the_template_as_a_file(saved_dir: Path) -> None:
    assert (saved_dir / "chat_template.jinja").read_text() == TEMPLATE
    assert "chat_template" not in json.loads((saved_dir / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("messages", CHATS)
def test_chat_answers_with_transformers_prompt(
    client: OpenAI, saved_dir: Path, messages: list[dict]
) -> None:
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(saved_dir).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens == len(expected)
    template = ChatTemplate.load(saved_dir, TextTokenizer(saved_dir, {}))
    assert template is not None
    assert template.encode({"messages": messages}) == list(expected)


def test_the_file_takes_priority_over_the_config(saved_dir: Path, tmp_path: Path) -> None:
    """transformers: "independent chat template file(s) ... take priority" over the config."""
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((saved_dir / name).read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": STALE}))
    body = {"messages": CHATS[0]}
    ours = ChatTemplate.load(tmp_path, TextTokenizer(tmp_path, {}))
    assert ours is not None
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        CHATS[0], tokenize=False, add_generation_prompt=True
    )
    assert ours.render(body) == theirs and "overrides" not in theirs
    (tmp_path / "chat_template.jinja").unlink()
    fallback = ChatTemplate.load(tmp_path, TextTokenizer(tmp_path, {}))
    assert fallback is not None and "overrides" in fallback.render(body)
