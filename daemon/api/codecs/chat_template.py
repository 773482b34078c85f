"""A checkpoint's own chat template (chat_template.jinja, else tokenizer_config.json
"chat_template"; jinja2) for model families that deepseek-recipe does not cover."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.api.codecs.base import CodecError
from daemon.api.codecs.dense_tools import ToolRequest, tool_request
from daemon.models.tokenizer import TextTokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where current transformers saves it

# As OpenAI lists them (its error message names them in this order).
ROLES = ("system", "assistant", "user", "function", "tool", "developer")


@dataclass
class ChatTemplate:
    template: jinja2.Template
    tokenizer: TextTokenizer
    special: dict[str, str]  # bos_token / eos_token spellings the template may use
    tool_parser: str | None = None  # the format of tool calls in the output (tool_parsers)

    @classmethod
    def load(
        cls, model_dir: Path, tokenizer: TextTokenizer, tool_parser: str = "auto"
    ) -> ChatTemplate | None:
        """`tool_parser`: auto (from the template's own tool-call format), none, or a parser.
        A tokenizer that carries its template (a GGUF file's) is not looked up in `model_dir`."""
        source: str | None
        if tokenizer.chat_template is not None:
            cfg: dict[str, Any] = dict(tokenizer.special_tokens)
            source = tokenizer.chat_template
        else:
            path = model_dir / "tokenizer_config.json"
            cfg = json.loads(path.read_text()) if path.is_file() else {}
            source = _source(model_dir, cfg)
        if source is None:
            return None
        # as transformers renders chat templates
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        env.filters["tojson"] = _tojson
        special = {k: _spelling(cfg.get(k)) for k in ("bos_token", "eos_token")}
        parser = _detect_parser(source) if tool_parser == "auto" else tool_parser
        return cls(
            env.from_string(source), tokenizer, special, None if parser == "none" else parser
        )

    def render(
        self, body: dict[str, Any], tools: ToolRequest | None = None, image_text: str = ""
    ) -> str:
        """`tools` (checked from the body when not given): rendered unless tool_choice none;
        `image_text`: what an image part becomes in the text (a vision model's image token)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise CodecError("'messages' must be a non-empty array", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise CodecError("each message must be an object with a string 'role'", "messages")
        messages = [_message(i, m, image_text) for i, m in enumerate(messages)]
        tools = tool_request(body) if tools is None else tools
        try:
            return self.template.render(
                messages=messages,
                tools=tools.tools if tools.active else None,
                add_generation_prompt=body.get("add_generation_prompt", True),
                **self.special,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # e.g. str + a missing name
            raise CodecError(f"the chat template rejected the messages: {e}", "messages") from None

    def encode(
        self, body: dict[str, Any], tools: ToolRequest | None = None, image_text: str = ""
    ) -> list[int]:
        text = self.render(body, tools, image_text)
        return self.tokenizer.encode(text, add_special_tokens=False)


def _source(model_dir: Path, cfg: dict[str, Any]) -> str | None:
    """As transformers reads it: chat_template.jinja, which current transformers saves, takes
    priority over the tokenizer config's entry."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    source = cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    return source if isinstance(source, str) else None


def _message(i: int, m: dict[str, Any], image_text: str = "") -> dict[str, Any]:
    """A message as chat templates take it: text content, and the arguments of an assistant's
    tool calls as objects (transformers' templates expect them so; OpenAI sends JSON text)."""
    role = m["role"]
    if role not in ROLES:
        names = ", ".join(repr(r) for r in ROLES)
        raise CodecError(
            f"Invalid value: {role!r}. Supported values are: {names}.",
            f"messages[{i}].role",
            "invalid_value",
        )
    out = m | {"content": _text(m.get("content"), image_text)}
    if role == "developer":  # OpenAI's newer name for system; templates know only system
        out["role"] = "system"
    calls = m.get("tool_calls")
    if not calls:
        out.pop("tool_calls", None)
        return out
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise CodecError("'tool_calls' must be an array of objects", f"messages[{i}].tool_calls")
    out["tool_calls"] = [_template_call(c) for c in calls]
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except (json.JSONDecodeError, RecursionError):
        return call  # rendered as the text it is
    return call | {"function": fn | {"arguments": args}}


def _detect_parser(source: str) -> str:
    """The tool-call format a template teaches: Hermes tags (Qwen2.5, Qwen3), Llama 3.1+ JSON."""
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or '"parameters": dictionary' in source:
        return "llama3_json"
    return "none"


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _text(content: Any, image_text: str = "") -> str:
    """Message content: a string, or OpenAI content parts of which the text ones are kept (and
    each image_url part as `image_text`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(
            p["text"]
            if p.get("type") == "text" and isinstance(p.get("text"), str)
            else image_text
            if p.get("type") == "image_url"
            else ""
            for p in content
        )
    raise CodecError("message 'content' must be a string or an array of parts", "messages")


def _spelling(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
