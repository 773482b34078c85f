"""A GGUF file's config and tokenizer kept as JSON beside its cached weights: a restart that
reads the weights from the cache never parses the file (its metadata parse takes seconds)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog
from tokenizers import Tokenizer

from daemon.models.gguf_checkpoint.config import gguf_config
from daemon.models.gguf_checkpoint.keys import file_key
from daemon.models.gguf_checkpoint.reader import open_gguf
from daemon.models.gguf_checkpoint.vocab import GGUFVocab, gguf_vocab

log = structlog.get_logger(__name__)
T = TypeVar("T")


def kept_config(gguf_file: Path, cache: Path | None) -> dict[str, Any]:
    """The config dict of `gguf_file` (gguf_config), from `cache` where it was kept."""
    return _kept(gguf_file, cache, "config", _config, lambda d: d, lambda c: c)


def kept_vocab(gguf_file: Path, cache: Path | None) -> GGUFVocab:
    """The tokenizer of `gguf_file` (gguf_vocab), from `cache` where it was kept."""
    return _kept(gguf_file, cache, "vocab", _vocab, _vocab_from, _vocab_to)


def _config(gguf_file: Path) -> dict[str, Any]:
    return gguf_config(open_gguf(gguf_file), gguf_file.name)


def _vocab(gguf_file: Path) -> GGUFVocab:
    return gguf_vocab(open_gguf(gguf_file), gguf_file.name)


def _vocab_to(v: GGUFVocab) -> dict[str, Any]:
    return {
        "tokenizer": v.tokenizer.to_str(),
        "eos_token_ids": list(v.eos_token_ids),
        "chat_template": v.chat_template,
        "special": v.special,
    }


def _vocab_from(d: dict[str, Any]) -> GGUFVocab:
    return GGUFVocab(
        Tokenizer.from_str(d["tokenizer"]),
        tuple(d["eos_token_ids"]),
        d["chat_template"],
        d["special"],
    )


def _kept(
    gguf_file: Path,
    cache: Path | None,
    kind: str,
    build: Callable[[Path], T],
    decode: Callable[[dict], T],
    encode: Callable[[T], dict],
) -> T:
    if cache is None:
        return build(gguf_file)
    file = cache / f"{file_key(gguf_file, kind)}.{kind}.json"
    try:
        return decode(orjson.loads(file.read_bytes()))
    except FileNotFoundError:
        pass
    except Exception as e:  # `tokenizers` raises plain Exceptions
        # a damaged file, or one `tokenizers` cannot read: built again from the GGUF file
        log.warning("gguf_metadata_cache_unreadable", file=str(file), error=str(e))
    value = build(gguf_file)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(orjson.dumps(encode(value)))
        os.replace(tmp, file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("gguf_metadata_cache_not_written", file=str(file), error=str(e))
    return value
