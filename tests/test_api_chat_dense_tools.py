"""Dense chat with tools: rendered by the checkpoint's template (Qwen2.5-style Hermes, Llama 3.1
JSON), calls read back as OpenAI tool_calls, held to their schemas for required/named choices."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.service.settings import ConfigError, load_settings
from tests.checkpoints import make_dense_checkpoint
from tests.conftest import LiveServer

# Modeled on Qwen2.5-Instruct's tokenizer_config.json chat_template (its tool parts verbatim).
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Modeled on Llama-3.1-Instruct's chat_template: tools in the first user message, calls as
# {"name": ..., "parameters": ...}, tool results under the ipython role.
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "tz": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}/[A-Z][a-z]{1,8}$"}
            },
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris, and the time there?"}]
# what each format's auto parser must read back (the output forced by a regex)
CALL_TEXT = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
}


def _served(tmp: Path, model_type: str, template: str) -> LiveServer:
    path = make_dense_checkpoint(
        tmp, model_type=model_type, with_tokenizer=True, max_position_embeddings=2048
    )
    cfg_path = path / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"chat_template": template}))
    return LiveServer(
        EngineConfig(
            model=str(path),
            served_model_name=model_type,
            kv_cache_memory_gb=0.05,
            max_num_seqs=8,
            max_model_len=1024,
        ),
        ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1),
    )


@pytest.fixture(
    scope="module",
    params=[
        ("qwen2", QWEN25_TEMPLATE, "hermes"),
        ("qwen3", QWEN25_TEMPLATE, "hermes"),
        ("llama", LLAMA31_TEMPLATE, "llama3_json"),
    ],
    ids=["qwen2-hermes", "qwen3-hermes", "llama-llama3_json"],
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, OpenAI, str]]:
    model_type, template, fmt = request.param
    server = _served(tmp_path_factory.mktemp(model_type), model_type, template)
    server.start()
    client = OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    yield server, client, fmt
    server.stop()


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _prompt_text(server: LiveServer, model: str, **body: object) -> str:
    tokens = _post(server, "/tokenize", {"model": model, "messages": ASK} | body)["tokens"]
    return _post(server, "/detokenize", {"tokens": tokens})["prompt"]


def _post(server: LiveServer, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _model(server: LiveServer) -> str:
    return server.engine_cfg.served_model_name or ""


def test_tools_rendered_unless_tool_choice_none(served: tuple[LiveServer, OpenAI, str]) -> None:
    server, client, _ = served
    model = _model(server)
    with_tools = _prompt_text(server, model, tools=TOOLS)
    assert '"name": "get_weather"' in with_tools and "get_time" in with_tools
    assert _prompt_text(server, model, tools=TOOLS, tool_choice="none") == _prompt_text(
        server, model
    )
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    none = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, tools=TOOLS, tool_choice="none"
    )
    auto = client.chat.completions.create(model=model, messages=ASK, max_tokens=1, tools=TOOLS)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_history_with_calls_renders_arguments_as_objects(
    served: tuple[LiveServer, OpenAI, str],
) -> None:
    server, _, _ = served
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    text = _prompt_text(server, _model(server), messages=messages, tools=TOOLS)
    assert '"get_weather", "arguments": {"city": "Paris"' in text or (
        '"get_weather", "parameters": {"city": "Paris"' in text
    )
    assert "18 C" in text


@pytest.mark.parametrize("seed", range(3))
def test_required_single_call_holds_the_schema(
    served: tuple[LiveServer, OpenAI, str], seed: int
) -> None:
    server, client, _ = served
    r = client.chat.completions.create(
        model=_model(server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=200,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)


def test_required_parallel_calls_hold_their_schemas(
    served: tuple[LiveServer, OpenAI, str],
) -> None:
    server, client, _ = served
    r = client.chat.completions.create(
        model=_model(server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=1,
        n=8,  # random weights: most samples run to max_tokens inside the grammar
        max_tokens=300,
    )
    finished = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert finished, [c.finish_reason for c in r.choices]
    for c in finished:
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)


def _streamed_calls(chunks: list) -> tuple[list[dict], str | None]:
    """Tool calls assembled from stream deltas as the SDKs do; checks OpenAI's delta shape."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type, name
                    assert d.id and d.type == "function" and d.function.name
                    assert d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("seed", range(2))
def test_named_choice_whole_and_streamed(served: tuple[LiveServer, OpenAI, str], seed: int) -> None:
    server, client, _ = served
    args = dict(
        model=_model(server),
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=seed,
        max_tokens=200,
    )
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call.function.name, call.function.arguments)
    calls, finish = _streamed_calls(list(client.chat.completions.create(**args, stream=True)))
    assert finish == "tool_calls"
    assert calls == [{"name": "get_time", "arguments": call.function.arguments}]


def _literal_regex(text: str) -> str:
    out = []
    for ch in text:
        out.append("\\n" if ch == "\n" else ("\\" + ch if ch in "\\{}[]().*+?|^$/" else ch))
    return "".join(out)


def test_auto_reads_calls_from_the_output(served: tuple[LiveServer, OpenAI, str]) -> None:
    """The output forced to a call in the template's format, with tool_choice auto."""
    server, client, fmt = served
    text = CALL_TEXT[fmt]
    args = dict(
        model=_model(server),
        messages=ASK,
        tools=TOOLS,
        max_tokens=120,
        response_format={"type": "regex", "regex": _literal_regex(text)},
    )
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == ("Sure." if fmt == "hermes" else None)
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    chunks = list(client.chat.completions.create(**args, stream=True))
    calls, finish = _streamed_calls(chunks)
    assert finish == "tool_calls"
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]
    content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert content == (whole.message.content or "")
    # without tools the same output is plain content
    plain = client.chat.completions.create(**(args | {"tools": None})).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": {"get_weather": {}}}, "tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}
                ],
                "tool_choice": "required",
            },
            "tools",  # the schema does not compile
        ),
    ],
)
def test_bad_tool_fields(served: tuple[LiveServer, OpenAI, str], kwargs: dict, param: str) -> None:
    server, client, _ = served
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(
            model=_model(server), messages=ASK, max_tokens=1, extra_body=kwargs
        )
    assert e.value.body["param"] == param


def test_tool_call_parser_setting() -> None:
    s = load_settings(env={"DEEPINFER_SERVER_TOOL_CALL_PARSER": "llama3_json"})
    assert s.server.tool_call_parser == "llama3_json"
    with pytest.raises(ConfigError, match="tool_call_parser"):
        load_settings(env={"DEEPINFER_SERVER_TOOL_CALL_PARSER": "mistral"})


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
        {"role": "assistant", "tool_calls": [{"id": "x", "function": "f"}]},
        {"role": "assistant", "tool_calls": "f"},
        {"role": "tool", "content": [{"type": "text", "text": 3}]},
        {"role": "user", "content": {"text": "hi"}},
    ],
)
def test_odd_history_is_never_a_5xx(served: tuple[LiveServer, OpenAI, str], message: dict) -> None:
    server, _, _ = served
    body = {"model": _model(server), "messages": ASK + [message], "tools": TOOLS, "max_tokens": 1}
    req = urllib.request.Request(
        server.base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
        assert json.loads(e.read())["error"]["type"] == "invalid_request_error"
    assert status in (200, 400)


def test_forced_calls_grammar_is_built_on_the_pool_and_cached(tmp_path: Path) -> None:
    """The forced-calls tag (an xgrammar grammar per tool) is built in the grammar worker, keyed
    by the tools' JSON, so a repeated request builds nothing on the event loop; the compiler
    itself is made there too, by warm() (the daemon's, once it is ready) or the first grammar."""
    import asyncio
    import threading

    from daemon.api.codecs.base import CodecError
    from daemon.api.codecs.constraints import Constraints
    from daemon.models.tokenizer import TextTokenizer

    path = make_dense_checkpoint(tmp_path, with_tokenizer=True)
    tok = TextTokenizer(path, {})
    constraints = Constraints(tok, tok.vocab_size, (0,))
    assert constraints._compiler is None  # nothing of xgrammar's made at construction
    made_on: list[str] = []  # the threads that asked for the compiler
    compiler_now = constraints._compiler_now

    def recorded() -> object:
        made_on.append(threading.current_thread().name)
        return compiler_now()

    constraints._compiler_now = recorded
    constraints.warm()
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}]

    async def main() -> None:
        first = await constraints.for_forced_calls("hermes", TOOLS, single=False)
        again = await constraints.for_forced_calls("hermes", TOOLS, single=False)
        one = await constraints.for_forced_calls("llama3_json", TOOLS[:1], single=True)
        assert first.compiled is again.compiled and one.compiled is not first.compiled
        with pytest.raises(CodecError) as e:
            await constraints.for_forced_calls("hermes", bad, single=False)
        assert e.value.param == "tools" and "cannot be compiled" in e.value.message

    asyncio.run(main())
    kinds = [kind for kind, _ in constraints._cache]
    assert kinds == ["dense_tools:hermes", "dense_tools:llama3_json:one"]
    assert made_on and all(name.startswith("grammar") for name in made_on)
    constraints.close()


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_forced_call_strings_hold_no_control_characters(parser: str) -> None:
    """Length-bounded argument strings stay JSON (xgrammar's own schema element lets raw
    control characters into them), and the tag holds the bound."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from daemon.api.codecs.dense_tool_grammar import forced_calls_tag

    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 4}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    grammar = xgr.Grammar.from_structural_tag(forced_calls_tag(parser, [tool], single=True))
    key = "arguments" if parser == "hermes" else "parameters"

    def call(city: str) -> str:
        text = '{"name": "f", "' + key + '": {"city": "' + city + '"}}'  # raw, not escaped
        return f"<tool_call>\n{text}\n</tool_call>" if parser == "hermes" else text

    assert _is_grammar_accept_string(grammar, call("Rome"))
    assert not _is_grammar_accept_string(grammar, call("Romes"))
    for raw in ("\t", "\x01"):
        assert not _is_grammar_accept_string(grammar, call("R" + raw)), repr(raw)
