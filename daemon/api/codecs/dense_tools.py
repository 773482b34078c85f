"""Chat Completions `tools`, `tool_choice` and `parallel_tool_calls` for dense models, checked
as OpenAI checks them (CodecError naming the field)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from daemon.api.codecs.base import CodecError
from daemon.api.codecs.params import get_bool

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"type": "function", ...}
    choice: str = "none"  # none | auto | required | named
    name: str | None = None  # the function a named choice forces
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools rendered into the prompt and calls read from the output."""
        return self.choice != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.active and self.choice in ("required", "named")

    def forced_tools(self) -> list[dict[str, Any]]:
        """The tools a forced choice may call."""
        if self.choice == "named":
            return [t for t in self.tools if t["function"]["name"] == self.name]
        return self.tools


def tool_request(body: dict[str, Any]) -> ToolRequest:
    tools = _tools(body.get("tools"))
    parallel = get_bool(body, "parallel_tool_calls", True)
    raw = body.get("tool_choice")
    if raw is None:
        return ToolRequest(tools, "auto" if tools else "none", None, parallel)
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise CodecError(
                f"Invalid value for 'tool_choice': {raw!r}; expected one of "
                f"{', '.join(CHOICES)} or a function object",
                "tool_choice",
            )
        choice, name = raw, None
    elif (
        isinstance(raw, dict)
        and raw.get("type") == "function"
        and isinstance(raw.get("function"), dict)
        and isinstance(raw["function"].get("name"), str)
    ):
        choice, name = "named", raw["function"]["name"]
    else:
        raise CodecError(
            "'tool_choice' must be none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if choice != "none" and not tools:
        raise CodecError(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
            "specified.",
            "tool_choice",
        )
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise CodecError(f"tool_choice names {name!r}, which is not among 'tools'", "tool_choice")
    return ToolRequest(tools, choice, name, parallel)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise CodecError("'tools' must be an array of function tools", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise CodecError(f"'{where}' must be an object with type 'function'", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise CodecError(f"'{where}.function' must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise CodecError(
                f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'",
                f"{where}.function.name",
            )
        if name in seen:
            raise CodecError(f"two tools are named {name!r}", f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and (
            not isinstance(params, dict) or params.get("type", "object") != "object"
        ):
            raise CodecError(
                f"'{where}.function.parameters' must be a JSON schema of type 'object'",
                f"{where}.function.parameters",
            )
    return raw
