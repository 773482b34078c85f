"""JSON Schema as xgrammar enforces it: the keywords its grammar holds every output to (a strict
schema with any other is refused, naming it) and the EBNF compiled from a schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

# Keywords that constrain nothing.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$schema",
        "$id",
        "contentEncoding",
        "contentMediaType",
    }
)
_DEFS = ("$defs", "definitions")
_GENERIC = frozenset({"type", "enum", "const", "$ref", "anyOf", "allOf", *_DEFS})
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
# The keywords each type enforces (found by compiling, sampling and validating against
# xgrammar 0.2.9; see tests/test_json_schema.py). Left out as unenforced: uniqueItems,
# contains / minContains / maxContains, dependentRequired, dependentSchemas, oneOf, not,
# if / then / else, multipleOf on numbers, $anchor and remote $refs, $dynamicRef.
_BY_TYPE: dict[str, frozenset[str]] = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": _NUMERIC | {"multipleOf"},
    "number": _NUMERIC,
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems"}),
    "object": frozenset(
        {
            "properties",
            "required",
            "additionalProperties",
            "minProperties",
            "maxProperties",
            "patternProperties",
            "propertyNames",
            "unevaluatedProperties",
        }
    ),
}
_TYPE_OF = {k: t for t, keys in _BY_TYPE.items() for k in keys if t != "number"}
_TYPE_OF.update({k: "number" for k in _NUMERIC})

# Formats whose xgrammar rule admits only valid values. Its date, date-time, ipv4 and hostname
# rules admit invalid ones (2024-02-30, 256.0.0.1, 64-letter labels) and its time rule endless
# fractions of a second: those go by the sound patterns below, which leave out February 29th,
# leap seconds, fractions past microseconds and hostnames past three labels (a subset of the
# valid values is still valid).
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = f"{_YEAR}-{_MONTH_DAY}"
# ((?:x[0-9]{1,6}|) for (?:x[0-9]{1,6})?: xgrammar 0.2.9 lets an optional group that
# holds a repetition match without its first element.)
_TIME = (
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6}|)"
    "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9]|)"
_FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "time": f"^{_TIME}$",
    "ipv4": f"^(?:{_OCTET}\\.){{3}}{_OCTET}$",
    # at most three labels, so never past 253 characters
    "hostname": f"^{_LABEL}(?:\\.{_LABEL}){{0,2}}$",
}
FORMATS = frozenset(
    {
        *_FORMAT_PATTERNS,
        "duration",
        "email",
        "ipv6",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
_STRING_TEXT = frozenset({"pattern", "format", "minLength", "maxLength"})

# xgrammar 0.2.9 lowers a length-bounded string to this class, which admits raw control
# characters (invalid JSON: mlc-ai/xgrammar#800); each is one JSON character without them.
_LOOSE_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_CHAR = '[^\\0-\\x1f\\"\\\\]'


@dataclass(frozen=True)
class Unenforced:
    """A keyword of a schema that the grammar would not hold, where it is, and why."""

    keyword: str
    path: str
    reason: str

    def message(self) -> str:
        where = f" (at {self.path})" if self.path else ""
        return f"'{self.keyword}'{where} is not supported: {self.reason}"


def ebnf(schema: Any) -> str:
    """The grammar of JSON values of `schema` (a dict or its JSON text), written as
    json.dumps writes it. ValueError / RuntimeError for a schema xgrammar refuses. Called on the
    grammar thread: xgrammar (~3 s with transformers) is imported there, not at start."""
    import xgrammar as xgr

    value = json.loads(schema) if isinstance(schema, str) else schema
    text = json.dumps(_sound_formats(value))
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
    return str(grammar).replace(_LOOSE_CHAR, _JSON_CHAR)


def unenforced(schema: Any) -> Unenforced | None:
    """The first keyword of `schema` that the grammar would not enforce, or None."""
    return _Checker(schema).node(schema, "")


def _sound_formats(node: Any) -> Any:
    """`node` with each format of _FORMAT_PATTERNS written as its pattern."""
    if isinstance(node, list):
        return [_sound_formats(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _sound_formats(v) if k not in ("enum", "const") else v for k, v in node.items()}
    fmt = node.get("format")
    pattern = _FORMAT_PATTERNS.get(fmt) if isinstance(fmt, str) else None
    if pattern is not None and "pattern" not in node:
        del out["format"]
        out["pattern"] = pattern
    return out


class _Checker:
    def __init__(self, root: Any) -> None:
        self.root = root
        self._validator: Any = None

    def node(self, node: Any, path: str) -> Unenforced | None:
        if isinstance(node, bool):
            return None
        if not isinstance(node, dict):
            return Unenforced("schema", path, "a schema must be an object or a boolean")
        found = self.keywords(node, path)
        if found is not None:
            return found
        for _key, sub, sub_path in _subschemas(node, path):
            found = self.node(sub, sub_path)
            if found is not None:
                return found
        return None

    def keywords(self, node: dict[str, Any], path: str) -> Unenforced | None:
        keys = set(node) - ANNOTATIONS
        types = node.get("type")
        types = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}
        for key in sorted(keys):
            if key not in _GENERIC and key not in _TYPE_OF:
                return Unenforced(key, path, "the grammar does not enforce this keyword")
        for key in ("$ref", "anyOf", "allOf"):
            if key in keys and keys - {key, *_DEFS}:
                other = sorted(keys - {key, *_DEFS})[0]
                return Unenforced(other, path, f"the grammar ignores keywords beside '{key}'")
        for key in sorted(keys):
            need = _TYPE_OF.get(key)
            if need is not None and not (
                need in types or (need == "number" and "integer" in types)
            ):
                return Unenforced(key, path, f"it needs a 'type' of {need}")
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref[:2] == "#/")):
            return Unenforced("$ref", path, "only local references (#/...) are supported")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) != 1:
            return Unenforced("allOf", path, "only an allOf of one schema is enforced")
        if "multipleOf" in keys and (types != {"integer"} or not _whole(node["multipleOf"])):
            return Unenforced("multipleOf", path, "only a whole multipleOf of integers")
        lead = next((k for k in ("format", "pattern") if k in keys), None)
        rest = sorted(keys & _STRING_TEXT - {lead})
        if lead is not None and rest:
            return Unenforced(rest[0], path, f"the grammar ignores it beside '{lead}'")
        if "format" in keys and not (isinstance(node["format"], str) and node["format"] in FORMATS):
            return Unenforced("format", path, f"format {node['format']!r} is not enforced")
        required = node.get("required")
        if isinstance(required, list):
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            missing = [r for r in required if not isinstance(r, str) or r not in props]
            if missing:
                return Unenforced("required", path, f"{missing[0]!r} is not in 'properties'")
        for key in ("enum", "const"):
            if key in keys and keys - {key, *_DEFS}:
                values = node[key] if key == "enum" else [node[key]]
                bad = self.invalid_value(node, values if isinstance(values, list) else [])
                if bad is not None:
                    reason = f"its value {json.dumps(bad)} fails the other keywords"
                    return Unenforced(key, path, reason)
        return None

    def invalid_value(self, node: dict[str, Any], values: list[Any]) -> Any:
        """The first of `values` that `node` (resolved in the root schema) rejects."""
        if self._validator is None:
            cls = jsonschema.validators.validator_for(self.root, jsonschema.Draft202012Validator)
            self._validator = cls(self.root)
        validator = self._validator.evolve(schema=node)
        for v in values:
            try:
                if not validator.is_valid(v):
                    return v
            except Exception:  # a malformed schema (jsonschema raises its own kinds)
                return v
        return None


def _subschemas(node: dict[str, Any], path: str) -> list[tuple[str, Any, str]]:
    out: list[tuple[str, Any, str]] = []
    for key in ("properties", "patternProperties", *_DEFS):
        if isinstance(node.get(key), dict):
            out += [(key, v, _join(path, key, k)) for k, v in node[key].items()]
    for key in ("prefixItems", "anyOf", "allOf"):
        if isinstance(node.get(key), list):
            out += [(key, v, _join(path, key, str(i))) for i, v in enumerate(node[key])]
    for key in (
        "items",
        "additionalProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "propertyNames",
    ):
        if key in node:
            out.append((key, node[key], _join(path, key)))
    names = out[-1][1] if out and out[-1][0] == "propertyNames" else None
    if isinstance(names, dict) and "type" not in names:  # property names are strings
        out[-1] = ("propertyNames", {"type": "string", **names}, out[-1][2])
    return out


def _join(path: str, *parts: str) -> str:
    return ".".join([path, *parts] if path else parts)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
