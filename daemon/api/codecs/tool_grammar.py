"""The xgrammar structural tag of DeepSeek-V4 tool calls: the DSML markup that the recipe's
stream parser reads, with each call's arguments held to its tool's parameter schema."""

from __future__ import annotations

import json
from typing import Any

from daemon.api.codecs.json_schema import ebnf

MARKER = "｜DSML｜"  # an added token; the parser sees markup only where it is that one token
# Any text. The marker token's text is unreachable for character rules (see tokenizer_info),
# so free text and raw string values can never contain markup.
_TEXT = "[^\\0]"
_NAME = "[a-zA-Z_][a-zA-Z0-9_]*"
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "examples",
        "default",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
    }
)
_STRING_LIMITS = frozenset({"minLength", "maxLength"})

Format = dict[str, Any]


def tool_call_tag(
    source: str, *, required: bool, marker_id: int, opened: bool = True, one: bool = False
) -> Format:
    """A structural tag for a tool-call constraint. `source` is the recipe's tool list (a JSON
    array of Chat Completions function tools). Required: one or more calls and the block's end
    follow, in a tool-calls block that the prompt has opened (`opened`) or that the output
    opens at once. Otherwise text, optionally followed by one tool-calls block. `one`: a
    single call per block. ValueError for a malformed list."""
    m = _Markup(marker_id)
    invokes = [m.invoke(name, params) for name, params in _tools(source)]
    if not invokes:
        raise ValueError("the tool list is empty")
    call = _or(invokes)
    calls = _seq(call if one else {"type": "plus", "content": call}, m.tag("</", "tool_calls>"))
    if required and opened:
        return {"type": "structural_tag", "format": calls}
    block = _seq(m.tag("<", "tool_calls>\n"), calls)
    if required:
        return {"type": "structural_tag", "format": block}
    text = _grammar(f"{_TEXT}*")
    return {"type": "structural_tag", "format": _seq(text, {"type": "optional", "content": block})}


def _tools(source: str) -> list[tuple[str, Any]]:
    try:
        tools = json.loads(source)
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool list is not JSON: {e}") from None
    if not isinstance(tools, list):
        raise ValueError("the tool list is not a JSON array")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError("each tool needs a function with a name")
        out.append((fn["name"], fn.get("parameters")))
    return out


class _Markup:
    """Formats of the DSML markup, each marker as its token."""

    def __init__(self, marker_id: int) -> None:
        self.marker = {"type": "token", "token": marker_id}

    def tag(self, before: str, after: str) -> Format:
        return _seq(_const(before), self.marker, _const(after))

    def invoke(self, name: str, params: Any) -> Format:
        return _seq(
            self.tag("<", f'invoke name="{name}">\n'),
            *self.parameters(params),
            self.tag("</", "invoke>\n"),
        )

    def parameters(self, schema: Any) -> list[Format]:
        """The declared properties in their order (optional ones may be left out); any named
        parameters when the schema declares none and allows others."""
        if not isinstance(schema, dict):
            return [self.any_parameters()]
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        if not props and not required:
            return [] if schema.get("additionalProperties") is False else [self.any_parameters()]
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        names = list(props) + [r for r in required if r not in props]
        out = []
        for name in names:
            param = self.parameter(name, props.get(name, {}), defs)
            out.append(param if name in required else {"type": "optional", "content": param})
        return out

    def parameter(self, name: str, schema: Any, defs: dict[str, Any]) -> Format:
        raw = _raw_string(schema)
        value = raw if raw is not None else _json_value(schema, defs)
        flag = "true" if raw is not None else "false"
        return _seq(
            self.tag("<", f'parameter name="{name}" string="{flag}">'),
            value,
            self.tag("</", "parameter>\n"),
        )

    def any_parameters(self) -> Format:
        value = _or(
            [
                _seq(_const('" string="true">'), _grammar(f"{_TEXT}*")),
                _seq(_const('" string="false">'), _json_value({}, {})),
            ]
        )
        param = _seq(
            self.tag("<", 'parameter name="'),
            _grammar(_NAME),
            value,
            self.tag("</", "parameter>\n"),
        )
        return {"type": "star", "content": param}


def _raw_string(schema: Any) -> Format | None:
    """The raw text of a string="true" value, for a schema that only admits strings and whose
    limits hold on the text itself; None: the value goes as JSON (string="false")."""
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - _ANNOTATIONS
    if schema.get("type", "string") != "string":
        return None
    if "enum" in keys or "const" in keys:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if keys - {"type", "enum", "const"} or not isinstance(values, list) or not values:
            return None
        if not all(isinstance(v, str) for v in values):
            return None
        return _or([_const(v) if v else _grammar('""') for v in dict.fromkeys(values)])
    if "type" not in keys:
        return None
    rest = keys - {"type"}
    if not rest:
        return _grammar(f"{_TEXT}*")
    if rest == {"pattern"} and isinstance(schema["pattern"], str):
        return {"type": "regex", "pattern": schema["pattern"]}
    if rest <= _STRING_LIMITS:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(lo, int) or not (hi is None or isinstance(hi, int)):
            return None
        return _grammar(f"{_TEXT}{{{lo},{-1 if hi is None else hi}}}")
    return None


def _json_value(schema: Any, defs: dict[str, Any]) -> Format:
    """A JSON value of `schema` (with the tool schema's definitions, for its $refs), laid out
    as json.dumps writes it."""
    if isinstance(schema, dict) and defs:
        schema = defs | schema
    return {"type": "grammar", "grammar": ebnf(schema)}


def _grammar(body: str) -> Format:
    return {"type": "grammar", "grammar": f"root ::= {body}"}


def _const(value: str) -> Format:
    return {"type": "const_string", "value": value}


def _seq(*elements: Format) -> Format:
    return {"type": "sequence", "elements": list(elements)}


def _or(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}
