"""A checkpoint's own chat template (tokenizer_config.json "chat_template", jinja2) for model
families that deepseek-recipe does not cover."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.api.errors import bad_request
from daemon.tokenizer import TextTokenizer


@dataclass
class ChatTemplate:
    template: jinja2.Template
    tokenizer: TextTokenizer
    special: dict[str, str]  # bos_token / eos_token spellings the template may use

    @classmethod
    def load(cls, model_dir: Path, tokenizer: TextTokenizer) -> ChatTemplate | None:
        path = model_dir / "tokenizer_config.json"
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if not isinstance(source, str):
            return None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda v, indent=None: json.dumps(
            v, ensure_ascii=False, indent=indent
        )
        special = {k: _spelling(cfg.get(k)) for k in ("bos_token", "eos_token")}
        return cls(env.from_string(source), tokenizer, special)

    def render(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise bad_request("each message must be an object with a string 'role'", "messages")
        messages = [m | {"content": _text(m.get("content"))} for m in messages]
        try:
            return self.template.render(
                messages=messages,
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                **self.special,
            )
        except jinja2.TemplateError as e:
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None

    def encode(self, body: dict[str, Any]) -> list[int]:
        return self.tokenizer.encode(self.render(body), add_special_tokens=False)


def _text(content: Any) -> str:
    """Message content: a string, or OpenAI content parts of which the text ones are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    raise bad_request("message 'content' must be a string or an array of parts", "messages")


def _spelling(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
