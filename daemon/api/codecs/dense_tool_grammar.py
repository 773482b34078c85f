"""The xgrammar structural tag that holds a dense model's output to tool calls in its own format
(hermes or llama3_json), each call's arguments to its tool's parameter schema."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from daemon.api.codecs.json_schema import ebnf

if TYPE_CHECKING:
    from xgrammar.structural_tag import Format

# parser -> (text before the name, between the name and the arguments, after them, separator)
_LAYOUT = {
    "hermes": ('<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": ('{"name": ', ', "parameters": ', "}", "; "),
}


def forced_calls_tag(parser: str, tools: list[dict[str, Any]], *, single: bool) -> str:
    """The structural tag (JSON) of one or more calls and nothing else: one of `tools` each,
    or exactly one call when `single` (a named choice, or parallel_tool_calls false). Called on
    the grammar thread: xgrammar is imported there, not at start."""
    from xgrammar.structural_tag import (
        GrammarFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
    )

    before, middle, after, separator = _LAYOUT[parser]
    tags = [
        TagFormat(
            begin=before + json.dumps(fn["name"]) + middle,
            # laid out as json.dumps writes it: no whitespace runs to loop on, and strings
            # as JSON allows them (xgrammar's own lets control characters into bounded ones)
            content=GrammarFormat(grammar=ebnf(fn.get("parameters") or {"type": "object"})),
            end=after,
        )
        for fn in (t["function"] for t in tools)
    ]
    fmt: Format
    if len(tags) == 1 and single:
        fmt = tags[0]
    else:
        fmt = TagsWithSeparatorFormat(
            tags=tags, separator=separator, at_least_one=True, stop_after_first=single
        )
    return StructuralTag(format=fmt).model_dump_json()
