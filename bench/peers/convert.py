"""A GGUF file as a Hugging Face checkpoint directory, for the peers that take one (vLLM): our
GGUF reader's config and dequantized float32 tensors (the ones deepinfer serves), transformers'
tokenizer and chat template (its model refuses to save a GGUF-loaded model).

python -m bench.peers.convert FILE.gguf OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from daemon.models.gguf_checkpoint.config import gguf_config
from daemon.models.gguf_checkpoint.reader import open_gguf
from daemon.models.gguf_checkpoint.weights import hf_tensors

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def convert(gguf: Path, out: Path) -> Path:
    """`out`, holding config.json, model.safetensors and the tokenizer files of `gguf`."""
    from transformers import AutoTokenizer

    reader = open_gguf(gguf)
    config = gguf_config(reader, gguf.name)
    tensors = {name: t.contiguous() for name, t in hf_tensors(reader, config)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config |= {
        "architectures": [ARCHITECTURES[config["model_type"]]],
        "torch_dtype": "float32",  # as stored; the servers are told their dtype
        "rope_theta": config["rope_parameters"]["rope_theta"],  # older transformers read this
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.convert", description=__doc__)
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if not a.gguf.is_file():
        print(f"bench.peers.convert: no such file: {a.gguf}", file=sys.stderr)
        return 1
    print(convert(a.gguf, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
