"""The tokenizer of a GGUF file (`tokenizers` BPE from its vocab, merges, token types and
special ids) and its chat template."""

from __future__ import annotations

from dataclasses import dataclass, field

from gguf import GGUFReader
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

from daemon.models.gguf_checkpoint.reader import GGUFError
from daemon.models.gguf_checkpoint.reader import field as meta

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# llama.cpp's pre-tokenizer names -> the pre-tokenization of the Hugging Face tokenizer it was
# converted from (the regexes as those tokenizer.json files spell them)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt2": _byte_level,
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level()]
    ),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3),
    "qwen2": lambda: _split_then_bytes(_QWEN2),
}


@dataclass
class GGUFVocab:
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special: dict[str, str] = field(default_factory=dict)  # bos_token / eos_token spellings


def gguf_vocab(reader: GGUFReader, name: str) -> GGUFVocab:
    kind = meta(reader, "tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise GGUFError(
            f"{name}: tokenizer model {kind!r} is not supported (supported: gpt2, byte-level BPE)"
        )
    pre = meta(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        supported = ", ".join(sorted(PRE_TOKENIZERS))
        raise GGUFError(f"{name}: pre-tokenizer {pre!r} is not supported (supported: {supported})")
    tokens: list[str] = meta(reader, "tokenizer.ggml.tokens")
    types: list[int] = meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k == CONTROL
        ]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    bos = meta(reader, "tokenizer.ggml.bos_token_id", None)
    eos = meta(reader, "tokenizer.ggml.eos_token_id", None)
    eot = meta(reader, "tokenizer.ggml.eot_token_id", None)
    if meta(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = {
        key: tokens[i] for key, i in (("bos_token", bos), ("eos_token", eos)) if i is not None
    }
    return GGUFVocab(
        tok,
        tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
        meta(reader, "tokenizer.chat_template", None),
        special,
    )
