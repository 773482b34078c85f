"""Tokenizer of a checkpoint (tokenizer.json via `tokenizers`, or a GGUF file's vocab) and its
end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from daemon.models.gguf_checkpoint.metadata_cache import kept_vocab
from daemon.models.gguf_checkpoint.reader import find_gguf


class TextTokenizer:
    def __init__(
        self, path: Path, hf_config: dict[str, Any], gguf_cache: Path | None = None
    ) -> None:
        """`path`: a checkpoint directory with tokenizer.json, or a GGUF file (or a directory
        holding one), whose vocab also carries the chat template (kept in `gguf_cache`, where
        given, for the next start)."""
        self.chat_template: str | None = None  # where the tokenizer carries it (GGUF)
        self.special_tokens: dict[str, str] = {}  # bos_token / eos_token spellings, with it
        gguf_file = find_gguf(path)
        if gguf_file is None:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            self.eos_token_ids = _eos_ids(path, hf_config, self.tokenizer)
            return
        vocab = kept_vocab(gguf_file, gguf_cache)
        self.tokenizer = vocab.tokenizer
        self.eos_token_ids = vocab.eos_token_ids
        self.chat_template, self.special_tokens = vocab.chat_template, vocab.special

    @classmethod
    def from_dir(
        cls, path: Path, hf_config: dict[str, Any], gguf_cache: Path | None = None
    ) -> TextTokenizer | None:
        if (path / "tokenizer.json").is_file() or find_gguf(path) is not None:
            return cls(path, hf_config, gguf_cache)
        return None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone, as logprob entries show it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(skip_special_tokens=skip_special_tokens)


def _eos_ids(path: Path, hf_config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (hf_config, _read_json(path / "generation_config.json")):
        value = source.get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    if not ids:
        token = _read_json(path / "tokenizer_config.json").get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            ids.append(tokenizer.token_to_id(token))
    return tuple(dict.fromkeys(ids))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
