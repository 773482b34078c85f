"""Grammar compilation for structured output: xgrammar grammars compiled in a worker thread
(never on the event loop) and cached by (kind, source)."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import xgrammar as xgr

from daemon.api.errors import bad_request
from daemon.api.tool_grammar import MARKER, tool_call_tag
from daemon.loop.constraint import GrammarConstraint
from daemon.tokenizer import TextTokenizer

log = structlog.get_logger(__name__)

TOOL_KINDS = ("tool_call", "tool_call_required")
ENFORCED_KINDS = ("json", "regex", *TOOL_KINDS)


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
        self.info = tokenizer_info(tokenizer, vocab_size, stop_ids)
        self.marker_id = marker_id(tokenizer)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], asyncio.Future[xgr.CompiledGrammar]] = (
            OrderedDict()
        )
        self._limit = cache

    def enforces(self, kind: str) -> bool:
        """Tool calls need the DSML marker token (DeepSeek tokenizers)."""
        return kind in ENFORCED_KINDS and (kind not in TOOL_KINDS or self.marker_id is not None)

    async def compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        """kind: json (source: a JSON schema, or "" for any JSON) | regex | tool_call or
        tool_call_required (source: the recipe's tool list). 400 if invalid."""
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
            raise bad_request(f"the output constraint cannot be compiled: {e}") from None

    def _compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        if kind == "json":
            if not source:
                return self.compiler.compile_builtin_json_grammar()
            return self.compiler.compile_json_schema(source, any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        if kind in TOOL_KINDS and self.marker_id is not None:
            tag = tool_call_tag(
                source, required=kind == "tool_call_required", marker_id=self.marker_id
            )
            return self.compiler.compile_structural_tag(json.dumps(tag))
        if kind == "structural_tag":  # source: a structural tag's JSON (dense tool calls)
            return self.compiler.compile_structural_tag(source)
        raise ValueError(f"unsupported constraint kind {kind!r}")

    async def for_response_format(self, fmt: Any) -> Grammar | None:
        """OpenAI `response_format` (dense path): json_object, json_schema, or regex."""
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise bad_request(
                "'response_format' must be an object with a 'type'", "response_format"
            )
        kind = fmt["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar(await self.compile("json", ""))
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("'response_format.json_schema.schema' must be an object")
            return Grammar(await self.compile("json", json.dumps(schema)))
        if kind == "regex" and isinstance(fmt.get("regex"), str):
            return Grammar(await self.compile("regex", fmt["regex"]))
        raise bad_request(f"unsupported response_format type {kind!r}", "response_format")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tokenizer_info(
    tokenizer: TextTokenizer, vocab_size: int, stop_ids: tuple[int, ...]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary; special tokens get no text, so no grammar emits them.
    The DSML marker token gets the byte 0xFF, never valid UTF-8: no character rule emits it,
    only a tool-call grammar's Token(id) (the recipe's parser reads markup by that token)."""
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
