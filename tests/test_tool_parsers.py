"""The hermes and llama3_json tool-call parsers on known outputs, whole and fed piece by piece."""

from __future__ import annotations

import json

import pytest

from daemon.api.codecs.tool_parsers import Parsed, ToolCall, parse, stream_parser

HERMES_TWO = (
    "Let me check both.\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "n": 2}}\n</tool_call>'
)
LLAMA_TWO = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "Europe/Paris", "n": 2}}'
)


def _calls(p: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in p.calls]


def _streamed(name: str, text: str, step: int) -> Parsed:
    """The events of `text` fed `step` characters at a time, joined as the client would."""
    parser = stream_parser(name)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return Parsed(None if calls and not content.strip() else content, calls)


TWO_CALLS = [
    ("get_weather", {"city": "Paris"}),
    ("get_time", {"tz": "Europe/Paris", "n": 2}),
]


def test_hermes_two_calls_with_text_before() -> None:
    p = parse("hermes", HERMES_TWO)
    assert p.content == "Let me check both."
    assert _calls(p) == TWO_CALLS
    assert all(c.id.startswith("call_") for c in p.calls) and p.calls[0].id != p.calls[1].id


def test_hermes_only_calls_has_no_content() -> None:
    p = parse("hermes", HERMES_TWO.split("\n\n", 1)[1])
    assert p.content is None and _calls(p) == TWO_CALLS


def test_hermes_unclosed_last_call_and_string_arguments() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}'
    assert _calls(parse("hermes", text)) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "plain answer, no calls",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n["get_weather"]\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        "a < b and <tool_ but not a call  ",
        "",
    ],
)
def test_hermes_malformed_is_plain_text(text: str) -> None:
    p = parse("hermes", text)
    assert p.calls == [] and p.content == text


def test_llama3_json_two_calls() -> None:
    p = parse("llama3_json", LLAMA_TWO)
    assert p.content is None and _calls(p) == TWO_CALLS


def test_llama3_json_python_tag_and_arguments_key() -> None:
    text = '<|python_tag|>{"name": "f", "arguments": {"s": "a } b { \\" c"}}'
    assert _calls(parse("llama3_json", text)) == [("f", {"s": 'a } b { " c'})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"answer": 42}',
        '{"name": "f", "parameters": {"a": 1}',  # never closed
        '{"name": "f", "parameters": 3}',
        "{not json at all}",
        "  <|python_tag|>",
    ],
)
def test_llama3_json_malformed_is_plain_text(text: str) -> None:
    p = parse("llama3_json", text)
    assert p.calls == [] and p.content == text


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", HERMES_TWO),
        ("hermes", "no calls here <tool but text <tool_call"),
        ("hermes", "<tool_call>\n{bad}\n</tool_call>"),
        ("llama3_json", LLAMA_TWO),
        ("llama3_json", "  <|python_tag|>" + LLAMA_TWO),
        ("llama3_json", "Just words {with braces}"),
        ("llama3_json", '{"name": "f"'),
        (
            "llama3_json",
            '{"name": "f", "parameters": {"s": "a \\" } ]{ ; \\\\"}}; {"name": "g", "arguments": {}}',
        ),
    ],
)
def test_streamed_equals_whole(name: str, text: str, step: int) -> None:
    whole, streamed = parse(name, text), _streamed(name, text, step)
    assert streamed.content == whole.content
    assert _calls(streamed) == _calls(whole)


def test_llama3_json_stream_scans_each_character_once() -> None:
    """A long call fed 4 characters at a time is scanned in linear time, not from its '{' on every feed."""
    args = {"text": 'x \\" {[' * 2500}
    text = (
        json.dumps({"name": "f", "parameters": args})
        + "; "
        + json.dumps({"name": "g", "parameters": {}})
    )
    parser = stream_parser("llama3_json")
    events = []
    for i in range(0, len(text), 4):
        events += parser.feed(text[i : i + 4])
    events += parser.finish()
    assert [(e.name, json.loads(e.arguments)) for e in events] == [("f", args), ("g", {})]
    assert len(text) > 20_000 and parser.scanned <= len(text)


def test_stream_emits_text_before_calls_early() -> None:
    parser = stream_parser("hermes")
    assert parser.feed("Hi there <tool") == ["Hi there"]  # the partial marker is held
    assert parser.feed("_call>\n{") == []
    [call] = parser.feed('"name": "f", "arguments": {}}\n</tool_call>')
    assert isinstance(call, ToolCall) and call.name == "f" and call.arguments == "{}"
    assert parser.finish() == []
