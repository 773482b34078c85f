"""/v1/chat/completions on a dense Llama through the checkpoint's own jinja2 chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import BadRequestError, OpenAI

from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.models.tokenizer import TextTokenizer
from tests.checkpoints import make_dense_checkpoint
from tests.conftest import LiveServer

NAME = "tiny-llama-chat"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_dense_checkpoint(
        tmp_path_factory.mktemp("tiny-llama-chat"),
        with_tokenizer=True,
        max_position_embeddings=2048,
    )
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | {"chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator[LiveServer]:
    s = LiveServer(
        EngineConfig(
            model=str(chat_dir),
            served_model_name=NAME,
            kv_cache_memory_gb=0.05,
            max_num_seqs=8,
            max_model_len=1024,
            overlap=True,
        ),
        ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1),
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def _prompt_len(chat_dir: Path) -> int:
    tok = TextTokenizer(chat_dir, {})
    text = "<｜begin▁of▁sentence｜><|system|>Be brief.\n<|user|>Hello\n<|assistant|>"
    return len(tok.encode(text, add_special_tokens=False))


def test_whole(client: OpenAI, chat_dir: Path) -> None:
    r = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant" and isinstance(
        r.choices[0].message.content, str
    )
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == _prompt_len(chat_dir)


def test_stream_matches_whole(client: OpenAI) -> None:
    args = dict(
        model=NAME, messages=USER, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_logprobs(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=NAME,
        messages=USER,
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 3 for e in entries)


@pytest.mark.parametrize(
    "kwargs",
    [{"messages": []}, {"messages": [{"content": "x"}]}, {"temperature": -1}, {"n": 0}],
)
def test_bad_input(client: OpenAI, kwargs: dict) -> None:
    with pytest.raises(BadRequestError):
        client.chat.completions.create(**({"model": NAME, "messages": USER} | kwargs))


def test_responses_and_messages_answer_as_chat_does(client: OpenAI, server: LiveServer) -> None:
    """Through the same chat template: the same prompt (its length) and greedy text; tools
    are refused there (400 in each protocol's shape)."""
    from anthropic import Anthropic
    from anthropic import BadRequestError as AnthropicBadRequest

    chat = client.chat.completions.create(model=NAME, messages=USER, max_tokens=8, temperature=0)
    text = chat.choices[0].message.content
    resp = client.responses.create(
        model=NAME, instructions="Be brief.", input="Hello", max_output_tokens=8, temperature=0
    )
    assert (resp.output_text, resp.usage.input_tokens) == (text, chat.usage.prompt_tokens)
    claude = Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    msg = claude.messages.create(
        model=NAME,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        extra_body={"temperature": 0},  # this SDK has no argument for it
    )
    prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    assert (msg.content[0].text, prompt) == (text, chat.usage.prompt_tokens)
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    with pytest.raises(BadRequestError, match="tools"):
        client.responses.create(model=NAME, input="hi", tools=[tool], max_output_tokens=2)
    with pytest.raises(AnthropicBadRequest, match="tools"):
        claude.messages.create(
            model=NAME,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            max_tokens=2,
        )


def test_tokenize_messages_uses_template(server: LiveServer, chat_dir: Path) -> None:
    import urllib.request

    req = urllib.request.Request(
        server.url + "/tokenize",
        data=json.dumps({"model": NAME, "messages": USER}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as r:
        assert json.loads(r.read())["count"] == _prompt_len(chat_dir)


def test_regex_and_json_response_format(client: OpenAI) -> None:
    import re

    fmt = {"type": "regex", "regex": r"[a-z]{1,6}-[0-9]{2}"}
    for seed in range(5):
        r = client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=20, seed=seed, response_format=fmt
        )
        assert r.choices[0].finish_reason == "stop"
        assert re.fullmatch(fmt["regex"], r.choices[0].message.content)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    r = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=40, response_format=fmt
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)


def test_n_choices(client: OpenAI, chat_dir: Path) -> None:
    args = dict(model=NAME, messages=USER, max_tokens=6, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**args, n=3, seed=11, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3  # seed, seed+1, seed+2
    assert r.usage.prompt_tokens == _prompt_len(chat_dir) and r.usage.completion_tokens == 18
    greedy = client.chat.completions.create(**args, n=3, temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1
    chunks = list(
        client.chat.completions.create(
            **args, n=3, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = {i: "" for i in range(3)}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}
    assert all(t == greedy.choices[0].message.content for t in texts.values())
    assert chunks[-1].usage.completion_tokens == 18


def test_n_choices_with_a_grammar(client: OpenAI) -> None:
    fmt = {"type": "regex", "regex": r"[a-z]{1,6}-[0-9]{2}"}
    r = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=20, n=4, seed=3, response_format=fmt
    )
    import re

    assert all(re.fullmatch(fmt["regex"], c.message.content) for c in r.choices)


def test_unknown_role_is_rejected(client: OpenAI) -> None:
    messages = USER + [{"role": "wizard", "content": "abracadabra"}]
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert e.value.body["param"] == "messages[2].role"
    assert e.value.body["code"] == "invalid_value" and "'wizard'" in e.value.body["message"]


def test_developer_role_renders_as_system(client: OpenAI, chat_dir: Path) -> None:
    """Current OpenAI SDKs send `developer` where `system` was; the template sees `system`."""
    messages = [{"role": "developer", "content": "Be brief."}, USER[1]]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens == _prompt_len(chat_dir)


def test_tools_need_a_tool_call_format(client: OpenAI) -> None:
    """This template teaches no tool-call format: tools are refused, unless tool_choice none."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=USER, max_tokens=1, tools=[tool])
    assert e.value.body["param"] == "tools"
    r = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=1, tools=[tool], tool_choice="none"
    )
    assert r.choices[0].message.tool_calls is None


def test_logit_bias(client: OpenAI, chat_dir: Path) -> None:
    """OpenAI's `logit_bias`: +100 forces a token, -100 bans one; a bad map is a 400."""
    tok = TextTokenizer(chat_dir, {})
    forced = tok.encode("hello", add_special_tokens=False)[0]
    args = dict(model=NAME, messages=USER, max_tokens=3, temperature=0)
    r = client.chat.completions.create(**args, logit_bias={str(forced): 100})
    assert r.choices[0].message.content == tok.decode([forced] * 3)
    plain = client.chat.completions.create(**args, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    banned = client.chat.completions.create(
        **args,
        logprobs=True,
        logit_bias={str(tok.encode(first, add_special_tokens=False)[0]): -100},
    )
    assert banned.choices[0].logprobs.content[0].token != first
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(**args, logit_bias={"x": 1})
    assert e.value.body["param"] == "logit_bias"
