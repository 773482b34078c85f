"""Request bodies adapted before deepseek-recipe converts them, for what the official APIs accept
and the recipe does not. ValueError: the client's mistake (the codec answers it with a 400)."""

from __future__ import annotations

from typing import Any

Body = dict[str, Any]


def chat_body(body: Body) -> Body:
    """Chat Completions: `max_completion_tokens` (OpenAI's newer name; it wins over
    `max_tokens`, as in vLLM) and the `developer` role (current SDKs send it for `system`)."""
    body = dict(body)
    limit = body.pop("max_completion_tokens", None)
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise ValueError("'max_completion_tokens' must be an integer")
        body["max_tokens"] = limit
    messages = body.get("messages")
    if isinstance(messages, list):
        body["messages"] = [
            m | {"role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
            for m in messages
        ]
    return body


def messages_body(body: Body, *, counting: bool = False) -> Body:
    """Messages: `max_tokens` is required (not when `counting` tokens), and a tool of
    `"type": "custom"` is a client tool (litellm sends every client tool so)."""
    if not counting and body.get("max_tokens") is None:
        raise ValueError("max_tokens: Field required")
    tools = body.get("tools")
    if not isinstance(tools, list):
        return body
    custom = [
        {k: v for k, v in t.items() if k != "type"}
        if isinstance(t, dict) and t.get("type") == "custom"
        else t
        for t in tools
    ]
    return body | {"tools": custom}
