"""The name under which what is kept of a GGUF file (its weights, config, tokenizer) is cached:
torch-free, for the tokenizer's and the command line's imports."""

from __future__ import annotations

import hashlib
from pathlib import Path

# Raise when what is kept of a GGUF file changes (names, q/k row order, dequantization, the
# config or tokenizer built from its metadata): older cache files then stop matching.
FORMAT = 1


def file_key(gguf_file: Path, *parts: object) -> str:
    """A name for what is kept of `gguf_file` (with `parts`): its path, size and modification
    time, so a changed file misses."""
    st = gguf_file.stat()
    key = "|".join(map(str, (gguf_file.resolve(), st.st_size, st.st_mtime_ns, *parts, FORMAT)))
    return f"{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
