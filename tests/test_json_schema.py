"""Which JSON Schema keywords the grammar enforces (valid instances pass, invalid ones cannot be
written), and that every other one is named by `unenforced` (a strict schema's 400)."""

from __future__ import annotations

import contextlib
import json
import random
import re
from typing import Any

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from daemon.api.codecs.json_schema import _FORMAT_PATTERNS, ebnf, unenforced

STR = {"type": "string"}
INT = {"type": "integer"}
# name: (schema, valid instances, invalid instances)
ENFORCED: dict[str, tuple[Any, list[Any], list[Any]]] = {
    "type": (INT, [3], ["a", 1.5]),
    "type list": ({"type": ["integer", "null"]}, [3, None], ["a"]),
    "enum": ({"enum": ["a", 1, None]}, ["a", 1, None], ["b", 2]),
    "enum with type": ({"type": "string", "enum": ["a", "b"]}, ["a"], ["c"]),
    "const": ({"const": "x"}, ["x"], ["y"]),
    "minLength": (STR | {"minLength": 3}, ["abc"], ["ab"]),
    "maxLength": (STR | {"maxLength": 3}, ["abc", "éé"], ["abcd"]),
    "pattern": (STR | {"pattern": "^[a-c]+$"}, ["abc"], ["abd", ""]),
    "format date": (STR | {"format": "date"}, ["2024-04-30"], ["2024-04-31", "2024-02-30"]),
    "format date-time": (
        STR | {"format": "date-time"},
        ["2024-01-31T10:00:00Z", "2024-01-31T10:00:00.5+01:00"],
        ["2024-13-01T10:00:00Z", "2024-01-31T24:00:00Z", "2024-01-31", "2024-01-31T10:00:0012Z"],
    ),
    "format time": (STR | {"format": "time"}, ["10:00:00Z"], ["10:00:00", "x"]),
    "format duration": (STR | {"format": "duration"}, ["P1D", "PT1H"], ["P", "P1H"]),
    "format email": (STR | {"format": "email"}, ["a.b@c.de"], ["a@", "a b@c.d"]),
    "format ipv4": (STR | {"format": "ipv4"}, ["255.1.2.3"], ["256.1.2.3", "1.2.3"]),
    "format ipv6": (STR | {"format": "ipv6"}, ["::1", "fe80::1:2"], ["x", ":::"]),
    "format uuid": (
        STR | {"format": "uuid"},
        ["123e4567-e89b-12d3-a456-426614174000"],
        ["123e4567e89b12d3a456426614174000"],
    ),
    "format uri": (STR | {"format": "uri"}, ["http://a.b/c", "urn:a"], ["/rel", "a b"]),
    "format hostname": (STR | {"format": "hostname"}, ["a-b.c"], ["-a.c", "a" * 64 + ".c"]),
    "minimum": (INT | {"minimum": 3}, [3], [2]),
    "maximum": (INT | {"maximum": 3}, [3], [4]),
    "exclusiveMinimum": (INT | {"exclusiveMinimum": 3}, [4], [3]),
    "exclusiveMaximum": (INT | {"exclusiveMaximum": 3}, [2], [3]),
    "number bounds": (
        {"type": "number", "minimum": -1.25, "maximum": 2.5},
        [0, -1.25, 2.5, 1.3],
        [-1.3, 2.6],
    ),
    "multipleOf": (INT | {"multipleOf": 3}, [6, 0], [7]),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, [[1, 2]], [[1]]),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 2}, [[1, 2]], [[1, 2, 3]]),
    "prefixItems": (
        {"type": "array", "prefixItems": [INT, STR], "items": False},
        [[1, "a"]],
        [["a", 1], [1, "a", 2]],
    ),
    "required": ({"type": "object", "properties": {"a": INT}, "required": ["a"]}, [{"a": 1}], [{}]),
    "additionalProperties false": (
        {"type": "object", "properties": {"a": INT}, "additionalProperties": False},
        [{"a": 1}],
        [{"a": 1, "b": 2}],
    ),
    "additionalProperties schema": (
        {"type": "object", "additionalProperties": INT},
        [{"b": 2}],
        [{"b": "x"}],
    ),
    "min/maxProperties": (
        {"type": "object", "additionalProperties": INT, "minProperties": 1, "maxProperties": 1},
        [{"a": 1}],
        [{}, {"a": 1, "b": 2}],
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x[a-z]*$": INT}},
        [{"xa": 1}],
        [{"xa": "s"}, {"y": 1}],
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": INT},
        [{"xa": 1}],
        [{"yyy": 1}],
    ),
    "anyOf": ({"anyOf": [INT, {"type": "null"}]}, [1, None], ["a"]),
    "allOf of one": ({"allOf": [INT | {"minimum": 3}]}, [3], [2]),
    "$ref / $defs": ({"$defs": {"X": INT}, "$ref": "#/$defs/X"}, [1], ["a"]),
    "$ref / definitions": ({"definitions": {"X": INT}, "$ref": "#/definitions/X"}, [1], ["a"]),
    "recursive $ref": (
        {
            "type": "object",
            "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["n"],
            "additionalProperties": False,
        },
        [{"n": {"n": None}}],
        [{"n": 1}],
    ),
    "annotations": (
        INT | {"title": "t", "description": "d", "default": 1, "examples": [1]},
        [1],
        [],
    ),
}
# name: (schema, the keyword named)
UNENFORCED: dict[str, tuple[Any, str]] = {
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems"),
    "contains": ({"type": "array", "contains": INT}, "contains"),
    "minContains": ({"type": "array", "contains": INT, "minContains": 2}, "contains"),
    "dependentRequired": (
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        "dependentRequired",
    ),
    "oneOf": ({"oneOf": [INT, {"type": "number"}]}, "oneOf"),
    "not": (INT | {"not": {"const": 3}}, "not"),
    "if": (INT | {"if": {"minimum": 5}, "then": {"multipleOf": 2}}, "if"),
    "unknown keyword": (INT | {"frob": 3}, "frob"),
    "nullable (OpenAPI)": (INT | {"nullable": True}, "nullable"),
    "format idn-email": (STR | {"format": "idn-email"}, "format"),
    "unknown format": (STR | {"format": "frob"}, "format"),
    "number multipleOf": ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    "maxLength beside pattern": (STR | {"pattern": "^a+$", "maxLength": 3}, "maxLength"),
    "maxLength beside format": (STR | {"format": "email", "maxLength": 3}, "maxLength"),
    "pattern beside format": (STR | {"format": "email", "pattern": "^a"}, "pattern"),
    "maxLength without type": ({"maxLength": 3}, "maxLength"),
    "minimum beside $ref": ({"$defs": {"X": INT}, "$ref": "#/$defs/X", "minimum": 2}, "minimum"),
    "type beside anyOf": ({"type": "integer", "anyOf": [{"maximum": 3}]}, "type"),
    "allOf of two": ({"allOf": [INT, {"minimum": 3}]}, "allOf"),
    "remote $ref": ({"$ref": "http://example.com/s.json"}, "$ref"),
    "enum beside a failing keyword": ({"type": "string", "enum": ["a", 1]}, "enum"),
    "const beside maxLength": (STR | {"const": "abcd", "maxLength": 2}, "const"),
    "required not declared": (
        {"type": "object", "properties": {"a": INT}, "required": ["a", "b"]},
        "required",
    ),
}


def _wrap(schema: Any) -> dict[str, Any]:
    """As a required property of an object, so that keywords are checked at any depth."""
    return {
        "type": "object",
        "properties": {"v": schema},
        "required": ["v"],
        "additionalProperties": False,
    }


@pytest.mark.parametrize("name", list(ENFORCED))
def test_enforced_keywords_hold(name: str) -> None:
    schema, good, bad = ENFORCED[name]
    cases = [(schema, lambda v: v)]
    if "$ref" not in json.dumps(schema):  # (a $ref's pointer starts at the root)
        cases.append((_wrap(schema), lambda v: {"v": v}))
    for s, wrap in cases:
        assert unenforced(s) is None, unenforced(s)
        grammar = xgr.Grammar.from_ebnf(ebnf(s))
        for v in good:
            assert _is_grammar_accept_string(grammar, json.dumps(wrap(v), ensure_ascii=False)), v
        for v in bad:
            assert not _is_grammar_accept_string(
                grammar, json.dumps(wrap(v), ensure_ascii=False)
            ), v


@pytest.mark.parametrize("name", list(UNENFORCED))
def test_unenforced_keywords_are_named(name: str) -> None:
    schema, keyword = UNENFORCED[name]
    found = unenforced(_wrap(schema))
    assert found is not None and found.keyword == keyword, found
    assert found.path == "properties.v"
    assert f"'{keyword}'" in found.message()


def test_length_bounded_strings_hold_no_control_characters() -> None:
    """xgrammar 0.2.9 lets raw control characters (invalid JSON) into length-bounded strings."""
    grammar = xgr.Grammar.from_ebnf(ebnf(STR | {"minLength": 1, "maxLength": 4}))
    assert _is_grammar_accept_string(grammar, '"ab"')
    for raw in ("\t", "\x01", "\x1f"):
        assert not _is_grammar_accept_string(grammar, f'"a{raw}"'), repr(raw)


def test_the_issue_schema_is_enforced_as_written() -> None:
    schema = _wrap({"type": "string", "maxLength": 12})
    grammar = xgr.Grammar.from_ebnf(ebnf(schema))
    assert _is_grammar_accept_string(grammar, '{"v": "' + "a" * 12 + '"}')
    assert not _is_grammar_accept_string(grammar, '{"v": "' + "a" * 13 + '"}')


def test_any_json_object_is_an_object() -> None:
    grammar = xgr.Grammar.from_ebnf(ebnf({"type": "object"}))
    assert _is_grammar_accept_string(grammar, '{"a": [1, {"b": null}]}')
    assert not _is_grammar_accept_string(grammar, "[1]")
    assert not _is_grammar_accept_string(grammar, '"x"')


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "format": ["date"]},
        {"type": [{}], "maxLength": 2},
        {"type": "object", "properties": {}, "required": [{}]},
        {"type": "object", "properties": {"a": {"$ref": "#/nope"}}, "enum": [{"a": 1}]},
        {"type": "string", "minLength": "x", "enum": ["a"]},
    ],
)
def test_malformed_schemas_are_named_not_raised(schema: dict) -> None:
    """A strict check never raises on a malformed schema (a 400, never a 500)."""
    assert unenforced(schema) is not None
    with contextlib.suppress(ValueError, RuntimeError):  # the compile's 400
        ebnf(schema)


@pytest.mark.parametrize("fmt", sorted(_FORMAT_PATTERNS))
def test_format_patterns_match_as_python_reads_them(fmt: str) -> None:
    """The grammar of each replacement pattern accepts exactly what Python's re does (xgrammar
    0.2.9 misreads some regexes, e.g. an optional group holding a repetition)."""
    pattern = _FORMAT_PATTERNS[fmt]
    grammar = xgr.Grammar.from_ebnf(ebnf(STR | {"format": fmt}))
    rng = random.Random(0)
    alphabet = "0123456789-:.TZ+aZ"
    examples = {
        "date": ["2024-02-28", "2024-12-31"],
        "date-time": ["2024-01-31T10:00:00Z", "2024-01-31T10:00:00.123456-05:30"],
        "time": ["23:59:59Z", "00:00:00.1+14:00"],
        "ipv4": ["0.0.0.0", "255.255.255.255"],
        "hostname": ["a", "a-b.c", "x" * 63 + ".y.z"],
    }[fmt]
    seen = 0
    for text in examples + [_mutant(rng, examples, alphabet) for _ in range(600)]:
        want = re.fullmatch(pattern[1:-1], text) is not None
        assert _is_grammar_accept_string(grammar, json.dumps(text)) == want, text
        seen += want
    assert seen >= len(examples)


def _mutant(rng: random.Random, examples: list[str], alphabet: str) -> str:
    text = list(rng.choice(examples))
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(text) + 1)
        op = rng.random()
        if op < 0.4 and text:
            text[min(i, len(text) - 1)] = rng.choice(alphabet)
        elif op < 0.7:
            text.insert(i, rng.choice(alphabet))
        elif text:
            del text[min(i, len(text) - 1)]
    return "".join(text)
