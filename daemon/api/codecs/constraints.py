"""Grammar compilation for structured output: xgrammar grammars compiled in a worker thread
(never on the event loop) and cached by (kind, source)."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import deepseek_recipe as dr
import structlog

from daemon.api.codecs.base import CodecError
from daemon.api.codecs.dense_tool_grammar import forced_calls_tag
from daemon.api.codecs.json_schema import ANNOTATIONS, ebnf, unenforced
from daemon.api.codecs.tool_grammar import MARKER, tool_call_tag
from daemon.loop.constraint import GrammarConstraint
from daemon.models.tokenizer import TextTokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

log = structlog.get_logger(__name__)

# tool_call: text, then optionally a tool-calls block; tool_call_required: the prompt opened
# the block, calls follow; tool_call_any: the output opens the block at once (a call is due)
TOOL_KINDS = ("tool_call", "tool_call_required", "tool_call_any")
ENFORCED_KINDS = ("json", "regex", *TOOL_KINDS)
_ONE = ":one"  # kind suffix: at most one tool call
_DENSE_TOOLS = "dense_tools:"  # kind prefix: forced calls in a dense tool parser's format
_JSON_OBJECT = {"type": "object"}
_TOOL_TOP = frozenset(
    {"type", "properties", "required", "additionalProperties", "$defs", "definitions"}
)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar and the token after which it governs (None: from the first token)."""

    compiled: xgr.CompiledGrammar
    trigger: int | None = None

    def constraint(self) -> GrammarConstraint:
        """A fresh matcher: every engine request needs its own."""
        return GrammarConstraint(self.compiled, self.trigger)


class Constraints:
    def __init__(
        self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: tuple[int, ...], cache: int = 256
    ) -> None:
        self.marker_id = marker_id(tokenizer)
        # xgrammar (with transformers, ~3 s) is imported and its vocabulary built on the
        # grammar thread, not at start: from warm(), or by the first grammar compiled
        self._vocab = (tokenizer, vocab_size, stop_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], asyncio.Future[xgr.CompiledGrammar]] = (
            OrderedDict()
        )
        self._limit = cache

    def warm(self) -> None:
        """Make the compiler now, on the grammar thread (a first grammar then waits for it)."""
        self._pool.submit(self._compiler_now)

    def _compiler_now(self) -> xgr.GrammarCompiler:
        """The compiler, made on first use; only the grammar thread calls this."""
        if self._compiler is None:
            import xgrammar as xgr

            info = tokenizer_info(*self._vocab)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def enforces(self, kind: str) -> bool:
        """Tool calls need the DSML marker token (DeepSeek tokenizers)."""
        base = kind.removesuffix(_ONE)
        return base in ENFORCED_KINDS and (base not in TOOL_KINDS or self.marker_id is not None)

    async def for_recipe(
        self, oc: dr.OutputConstraint, options: OutputOptions, trigger: int | None
    ) -> Grammar | None:
        """The recipe's OutputConstraint as a grammar, with what the client asked beyond it;
        `trigger`: the end-of-thinking token in thinking mode."""
        kind, source = options.kind(oc.kind), oc.schema
        if kind.startswith("tool_call_any") and trigger is not None:
            raise CodecError("Thinking mode does not support this tool_choice")
        if oc.kind == "json" and options.schema is not None:
            source = options.schema
        if not self.enforces(kind):
            return None
        return Grammar(await self.compile(kind, source), trigger)

    async def compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        """kind: json (source: a JSON schema, or "" for any JSON object) | regex | one of
        TOOL_KINDS, with ":one" for at most one call (source: the recipe's tool list) |
        "dense_tools:<parser>", with ":one" for exactly one call (source: the tools' JSON).
        CodecError if invalid."""
        key = (kind, source)
        fut = self._cache.get(key)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._pool, self._compile, kind, source)
            self._cache[key] = fut
            while len(self._cache) > self._limit:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        try:
            return await asyncio.shield(fut)
        except (ValueError, RuntimeError) as e:
            self._cache.pop(key, None)
            if kind.startswith(_DENSE_TOOLS):  # a parameter schema xgrammar refuses
                raise CodecError(
                    f"the tools' parameters cannot be compiled: {e}", "tools"
                ) from None
            raise CodecError(f"the output constraint cannot be compiled: {e}") from None

    async def for_forced_calls(
        self, parser: str, tools: list[dict[str, Any]], *, single: bool
    ) -> Grammar:
        """Dense tool_choice required or named: calls in `parser`'s format and nothing else,
        of one of `tools` each (exactly one call when `single`)."""
        kind = _DENSE_TOOLS + parser + (_ONE if single else "")
        return Grammar(await self.compile(kind, json.dumps(tools)))

    def _compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        compiler = self._compiler_now()
        if kind == "json":
            return compiler.compile_grammar(ebnf(source or _JSON_OBJECT))
        if kind == "regex":
            return compiler.compile_regex(source)
        base, one = kind.removesuffix(_ONE), kind.endswith(_ONE)
        if base in TOOL_KINDS and self.marker_id is not None:
            tag = tool_call_tag(
                source,
                required=base != "tool_call",
                opened=base == "tool_call_required",
                one=one,
                marker_id=self.marker_id,
            )
            return compiler.compile_structural_tag(json.dumps(tag))
        if kind.startswith(_DENSE_TOOLS):  # source: the forced tools' JSON
            tag = forced_calls_tag(base.removeprefix(_DENSE_TOOLS), json.loads(source), single=one)
            return compiler.compile_structural_tag(tag)
        raise ValueError(f"unsupported constraint kind {kind!r}")

    async def for_response_format(self, fmt: Any) -> Grammar | None:
        """OpenAI `response_format` (dense path): json_object, json_schema, or regex."""
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise CodecError("'response_format' must be an object with a 'type'", "response_format")
        kind = fmt["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar(await self.compile("json", ""))
        if kind == "json_schema":
            schema = _format_schema(fmt.get("json_schema"), "response_format")
            if schema is None:
                raise CodecError("'response_format.json_schema.schema' must be an object")
            return Grammar(await self.compile("json", json.dumps(schema)))
        if kind == "regex" and isinstance(fmt.get("regex"), str):
            return Grammar(await self.compile("regex", fmt["regex"]))
        raise CodecError(f"unsupported response_format type {kind!r}", "response_format")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class OutputOptions:
    """What a DeepSeek-path body asks of the output that the recipe's OutputConstraint leaves
    out: the client's own JSON schema (the recipe's strict parse drops keywords it does not
    know, maxLength among them), Anthropic's tool_choice any (a call is due), and at most one
    tool call (parallel_tool_calls false, disable_parallel_tool_use)."""

    schema: str | None = None
    any_call: bool = False
    one_call: bool = False

    @classmethod
    def read(cls, protocol: str, body: dict[str, Any]) -> tuple[OutputOptions, dict[str, Any]]:
        """The options of a chat / responses / messages body, and the body for the recipe:
        without a json_schema's `strict`, which is checked here against what the grammar
        enforces (CodecError naming a keyword it does not) rather than by the recipe's subset."""
        choice = body.get("tool_choice")
        choice = choice if isinstance(choice, dict) else {}
        if protocol == "messages":
            any_call = choice.get("type") == "any"
            one_call = choice.get("disable_parallel_tool_use") is True
        else:
            any_call, one_call = False, body.get("parallel_tool_calls") is False
        schema, body = _client_schema(protocol, body)
        return cls(schema, any_call, one_call), _loose_tools(protocol, body)

    def kind(self, recipe_kind: str) -> str:
        kind = recipe_kind
        if kind == "tool_call" and self.any_call:
            kind = "tool_call_any"
        if kind in TOOL_KINDS and self.one_call:
            kind += _ONE
        return kind


def _client_schema(protocol: str, body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The json_schema format's schema (as JSON) and the body without its `strict`."""
    if protocol == "chat":
        fmt, param = body.get("response_format"), "response_format"
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    elif protocol == "responses":
        text, param = body.get("text"), "text.format"
        fmt = text.get("format") if isinstance(text, dict) else None
        spec = fmt
    else:
        return None, body
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(spec, dict):
        return None, body
    schema = _format_schema(spec, param)
    if schema is None:
        return None, body  # the recipe says what is wrong
    loose = {k: v for k, v in spec.items() if k != "strict"}
    if protocol == "chat":
        body = body | {"response_format": fmt | {"json_schema": loose}}
    else:
        body = body | {"text": body["text"] | {"format": loose}}
    return json.dumps(schema), body


def _format_schema(spec: Any, param: str) -> dict[str, Any] | None:
    """A json_schema format's schema, checked against what the grammar enforces when it is
    strict (CodecError naming `param`); None when `spec` holds no schema object."""
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        return None
    if spec.get("strict") is True:
        check_strict(schema, param)
    return schema


def _loose_tools(protocol: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body with its function tools' `strict` left out: the recipe's strict parse drops
    keywords (maxLength, enum...) from their parameters, in the prompt and the constraint
    alike. A strict tool's parameters are checked here instead."""
    tools = body.get("tools")
    if protocol == "messages" or not isinstance(tools, list):
        return body
    out, changed = [], False
    for i, tool in enumerate(tools):
        chat = protocol == "chat"
        fn = tool.get("function") if chat and isinstance(tool, dict) else tool
        if not isinstance(fn, dict) or "strict" not in fn or tool.get("type") != "function":
            out.append(tool)
            continue
        if fn["strict"] is True and isinstance(fn.get("parameters"), dict):
            where = f"tools[{i}].function.parameters" if chat else f"tools[{i}].parameters"
            check_strict_parameters(fn["parameters"], where)
        loose = {k: v for k, v in fn.items() if k != "strict"}
        out.append(tool | {"function": loose} if chat else loose)
        changed = True
    return body | {"tools": out} if changed else body


def check_strict_parameters(schema: dict[str, Any], param: str) -> None:
    """check_strict for a tool's parameters, whose top level the tool-call grammar writes as
    its declared properties, one markup element each."""
    top = set(schema) - ANNOTATIONS - _TOOL_TOP
    if top:
        keyword = sorted(top)[0]
        raise CodecError(
            f"Invalid schema for '{param}': '{keyword}' is not supported at the top level of "
            "a tool's parameters",
            param,
        )
    check_strict(schema, param)


def check_strict(schema: Any, param: str) -> None:
    """CodecError naming the first keyword of a strict schema that the grammar would not hold
    every output to, as OpenAI refuses a strict schema with a keyword it does not support."""
    found = unenforced(schema)
    if found is not None:
        raise CodecError(f"Invalid schema for '{param}': {found.message()}", param)


def tokenizer_info(
    tokenizer: TextTokenizer, vocab_size: int, stop_ids: tuple[int, ...]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary; special tokens get no text, so no grammar emits them.
    The DSML marker token gets the byte 0xFF, never valid UTF-8: no character rule emits it,
    only a tool-call grammar's Token(id) (the recipe's parser reads markup by that token)."""
    import xgrammar as xgr

    tok = tokenizer.tokenizer
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    vocab = ["" if i in special else (tok.id_to_token(i) or "") for i in range(vocab_size)]
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    if "ByteLevel" in kinds:
        vocab_type = xgr.VocabType.BYTE_LEVEL
        marker = marker_id(tokenizer)
        if marker is not None and marker < vocab_size:
            vocab[marker] = "\u00ff"  # byte-level spelling of the byte 0xFF
    elif "ByteFallback" in kinds:
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    return xgr.TokenizerInfo(
        vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
    )


def marker_id(tokenizer: TextTokenizer) -> int | None:
    """The DSML marker token of DeepSeek tokenizers, or None."""
    return tokenizer.tokenizer.token_to_id(MARKER)
