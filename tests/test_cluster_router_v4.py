"""DeepSeek-V4 (tiny, random) through a router, a prefill and a decode daemon: Chat
Completions, Responses (openai SDK) and Messages (anthropic SDK), streamed or not, answer as a
unified daemon does, with the KV state (paged blocks, SWA ring, compressor
state) handed over."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from anthropic import Anthropic
from openai import OpenAI

from tests.checkpoints import copy_tokenizer, make_v4_checkpoint
from tests.test_cluster_router import Cluster, Node, start_cluster

NAME = "tiny-v4"
TEXT = "Write about routers, prefill nodes and decode nodes, and how they share work. " * 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = copy_tokenizer(
        make_v4_checkpoint(tmp_path_factory.mktemp("tiny-v4"), vocab_size=129280)
    )
    extra = ("--kv-cache-memory-gb", "0.1", "--max-model-len", "4096")
    tmp = tmp_path_factory.mktemp("cluster-v4")
    yield from start_cluster(model, tmp, NAME, extra)


def _oai(node: Node) -> OpenAI:
    return OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _claude(node: Node) -> Anthropic:
    return Anthropic(base_url=node.url, api_key="x", max_retries=0, timeout=60)


def _chat(node: Node, text: str, stream: bool) -> tuple[str, str]:
    """(reasoning, content)"""
    kwargs = dict(
        model=NAME, messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0
    )
    if not stream:
        m = _oai(node).chat.completions.create(**kwargs).choices[0].message
        return (m.model_extra or {}).get("reasoning_content") or "", m.content or ""
    reasoning, content = [], []
    for c in _oai(node).chat.completions.create(stream=True, **kwargs):
        if c.choices:
            delta = c.choices[0].delta
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
    return "".join(reasoning), "".join(content)


def _responses(node: Node, text: str, stream: bool) -> list:
    kwargs = dict(model=NAME, input=text, max_output_tokens=8, temperature=0)
    if stream:
        events = list(_oai(node).responses.create(stream=True, **kwargs))
        response = events[-1].response
    else:
        response = _oai(node).responses.create(**kwargs)
    return [item.model_dump(exclude={"id", "encrypted_content"}) for item in response.output]


def _messages(node: Node, text: str, stream: bool) -> list:
    kwargs = dict(
        model=NAME,
        max_tokens=8,
        messages=[{"role": "user", "content": text}],
        extra_body={"temperature": 0},  # (this SDK's signature has none)
    )
    if stream:
        with _claude(node).messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = _claude(node).messages.create(**kwargs)
    return [block.model_dump() for block in message.content]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_v4_through_the_router_equals_a_unified_node(
    cluster: Cluster, protocol: str, stream: bool
) -> None:
    ask = {"chat": _chat, "responses": _responses, "messages": _messages}[protocol]
    before = cluster.decode.health()["kv_handoff_imported"]
    text = f"Case {protocol} {stream}. {TEXT}"  # no case hits another's cached prefix
    assert ask(cluster.router, text, stream) == ask(cluster.unified, text, stream)
    assert cluster.decode.health()["kv_handoff_imported"] == before + 1
