"""DeepSeek-V4 checkpoint loading: the three name spellings, FP8 block scales (DeepSeek's `.scale`
and Hugging Face's `weight_scale_inv`), multi-token-prediction tensors, and load errors.

One tiny random V4 is saved by transformers once; every other checkpoint here is rewritten from
its tensors with safetensors, and logits are compared with transformers' model."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from daemon.models.base import SeqSlice
from daemon.models.deepseek_v4.weights import is_scale, mtp_weights, weight_of_scale
from daemon.models.loader import ModelLoadError, dequantize_fp8, load_model
from tests.checkpoints import load_reference, make_v4_checkpoint

CPU = torch.device("cpu")
VOCAB = 300  # not a multiple of 128: head.weight [300, 64] has a partial FP8 scale block
BLOCK = 128
IDS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}

# the 2-D projection weights an FP8 checkpoint stores block-scaled, in each spelling
FP8_ORIGINAL = re.compile(
    r"(head|layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
    r"|ffn\.(experts\.\d+|shared_experts)\.w[123]))\.weight"
)
FP8_HF = re.compile(
    r"lm_head\.weight|model\.layers\.\d+\.("
    r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)\.weight"
    r"|mlp\.experts\.(gate_up_proj|down_proj)|mlp\.shared_experts\.(gate|up|down)_proj\.weight)"
)


# ---- helpers ---------------------------------------------------------------------------------


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 (not a dict)
    return out


def write_checkpoint(
    path: Path, config_from: Path, *shards: dict[str, torch.Tensor], **config_updates
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((config_from / "config.json").read_text()) | config_updates
    (path / "config.json").write_text(json.dumps(config))
    for i, shard in enumerate(shards, 1):
        name = "model.safetensors"
        if len(shards) > 1:
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(path / name))
    return path


def to_original(name: str) -> str:
    """save_pretrained's name -> DeepSeek's original one (no `model.` prefix, `attn.kv_norm`)."""
    name = name.removeprefix("model.")
    name = {
        "embed_tokens.weight": "embed.weight",
        "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base",
        "hc_head.hc_scale": "hc_head_scale",
    }.get(name, name)
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled float8_e4m3fn (amax / 448 per 128x128 block, partial edge blocks)."""
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(*w.shape[:-2], nr * BLOCK, nc * BLOCK)
    padded[..., :rows, :cols] = w
    blocks = padded.unflatten(-1, (nc, BLOCK)).unflatten(-3, (nr, BLOCK))  # [..., nr, B, nc, B]
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-8) / 448.0
    full = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :rows, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale.float()


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, block=(BLOCK, BLOCK)):
    """Reference dequantisation, one block at a time."""
    out = q.float().clone()
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[..., rows, cols] *= scale[..., i, j, None, None].float()
    return out


def load(path: Path, dtype: torch.dtype = torch.float32):
    return load_model(path, CPU, dtype).model


def our_logits(model) -> torch.Tensor:
    """One prefill of IDS through our model and its cache."""
    groups = model.kv_groups(torch.float32, 0)
    nb = 16
    cache = model.allocate_cache(groups, [1 if g.spec.per_request else nb for g in groups], CPU)
    tables = [[0] if g.spec.per_request else list(range(nb)) for g in groups]
    batch = cache.build_attention([SeqSlice(0, 0, len(IDS), tables, False)])
    with torch.inference_mode():
        return model.compute_logits(model(IDS, torch.arange(len(IDS)), batch, cache))


def ref_logits_of(reference) -> torch.Tensor:
    with torch.inference_mode():
        return reference(IDS[None]).logits[0].float()


def param_of(model, checkpoint_name: str) -> torch.Tensor:
    name, part = model.checkpoint_to_param(checkpoint_name)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    return model.param_view(name, params[name].data, part)


# ---- fixtures: one base checkpoint, its spellings, their logits ---------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4-saved"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def saved_tensors(saved: Path) -> dict[str, torch.Tensor]:
    return read_tensors(saved)


@pytest.fixture(scope="module")
def original_tensors(saved_tensors) -> dict[str, torch.Tensor]:
    return {to_original(k): v for k, v in saved_tensors.items()}


@pytest.fixture(scope="module")
def reference(saved: Path):
    return load_reference(saved)


@pytest.fixture(scope="module")
def hf_tensors(reference) -> dict[str, torch.Tensor]:
    # state_dict() holds persistent buffers only: the rotary inv_freq buffers are not in it
    return {k: v.detach().clone() for k, v in reference.state_dict().items()}


@pytest.fixture(scope="module")
def ref_logits(reference) -> torch.Tensor:
    return ref_logits_of(reference)


@pytest.fixture(scope="module")
def spellings(tmp_path_factory, saved, original_tensors, hf_tensors) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4-spellings")
    return {
        "save_pretrained": saved,
        "original": write_checkpoint(root / "original", saved, original_tensors),
        "hf": write_checkpoint(root / "hf", saved, hf_tensors),
    }


@pytest.fixture(scope="module")
def spelling_models(spellings) -> dict[str, torch.nn.Module]:
    return {name: load(path) for name, path in spellings.items()}


@pytest.fixture(scope="module")
def spelling_logits(spelling_models) -> dict[str, torch.Tensor]:
    return {name: our_logits(model) for name, model in spelling_models.items()}


# ---- 1. three spellings ------------------------------------------------------------------------


def test_spellings_are_what_they_claim(saved_tensors, original_tensors, hf_tensors):
    assert {"model.embed_tokens.weight", "head.weight", "model.layers.1.attn.norm.weight"} <= set(
        saved_tensors
    )
    assert {
        "embed.weight",
        "head.weight",
        "norm.weight",
        "hc_head_fn",
        "hc_head_base",
        "hc_head_scale",
        "layers.1.attn.wq_a.weight",
        "layers.1.attn.kv_norm.weight",
        "layers.1.attn.attn_sink",
        "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.1.ffn.experts.3.w3.weight",
        "layers.1.ffn.gate.bias",
        "layers.0.ffn.gate.tid2eid",
        "layers.1.hc_attn_scale",
    } <= set(original_tensors)
    assert not any(k.startswith("model.") for k in original_tensors)
    assert {
        "lm_head.weight",
        "model.hc_head.hc_fn",
        "model.layers.1.self_attn.q_a_proj.weight",
        "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.1.attn_hc.scale",
        "model.layers.0.mlp.gate.tid2eid",
    } <= set(hf_tensors)
    assert hf_tensors["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert not any("rotary_emb" in k for k in hf_tensors)


@pytest.mark.parametrize("spelling", ["save_pretrained", "original", "hf"])
def test_spelling_matches_transformers(spelling, spelling_logits, ref_logits):
    assert (spelling_logits[spelling] - ref_logits).abs().max() <= 1e-4


def test_spellings_load_identical_weights_and_logits(spelling_models, spelling_logits):
    base = spelling_models["save_pretrained"].state_dict()
    for name in ("original", "hf"):
        other = spelling_models[name].state_dict()
        assert other.keys() == base.keys()
        for k, v in base.items():
            assert torch.equal(other[k], v), (name, k)
        assert (spelling_logits[name] - spelling_logits["save_pretrained"]).abs().max() <= 1e-6


def test_rotary_buffers_in_a_checkpoint_are_ignored(tmp_path, saved, hf_tensors, reference):
    extra = {k: v for k, v in reference.named_buffers() if "rotary_emb" in k}
    assert extra
    path = write_checkpoint(tmp_path / "ck", saved, hf_tensors | extra)
    assert load(path) is not None


# ---- 2. FP8 block scales -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_original(tmp_path_factory, saved, original_tensors):
    """DeepSeek spelling, projections FP8 + `.scale`, the scales in a second shard; returns the
    path, the tensors, and the dequantised values per weight name."""
    weights, scales, dequantized = {}, {}, {}
    for k, v in original_tensors.items():
        if FP8_ORIGINAL.fullmatch(k):
            q, s = quantize(v)
            weights[k], scales[k.removesuffix("weight") + "scale"] = q, s
            dequantized[k] = dequantize_blockwise(q, s)
        else:
            weights[k] = v
    path = tmp_path_factory.mktemp("v4-fp8-original")
    write_checkpoint(path, saved, weights, scales, quantization_config=FP8_CONFIG)
    return path, weights | scales, dequantized


@pytest.fixture(scope="module")
def fp8_hf(tmp_path_factory, saved, hf_tensors):
    """Hugging Face spelling, FP8 + `weight_scale_inv` (stacked experts: `gate_up_proj_scale_inv`
    over the stacked [E, 2I, D] tensor)."""
    tensors, dequantized = {}, {}
    for k, v in hf_tensors.items():
        if FP8_HF.fullmatch(k):
            q, s = quantize(v)
            tensors[k], tensors[k + "_scale_inv"] = q, s  # x.weight_scale_inv, x_scale_inv
            dequantized[k] = dequantize_blockwise(q, s)
        else:
            tensors[k] = v
    path = tmp_path_factory.mktemp("v4-fp8-hf")
    write_checkpoint(path, saved, tensors, quantization_config=FP8_CONFIG)
    return path, tensors, dequantized


def test_fp8_checkpoints_cover_partial_and_single_blocks(fp8_original, fp8_hf):
    _, tensors, dequantized = fp8_original
    assert tensors["head.weight"].dtype == torch.float8_e4m3fn
    assert tensors["head.scale"].shape == (3, 1)  # 300 rows: 128 + 128 + 44
    assert tensors["layers.1.ffn.experts.0.w2.weight"].shape == (64, 32)
    assert tensors["layers.1.ffn.experts.0.w2.scale"].shape == (1, 1)
    assert tensors["layers.1.attn.indexer.wq_b.scale"].shape == (2, 1)
    assert len(dequantized) > 40
    # real parameters whose names end in "scale" stay what they are
    assert tensors["layers.1.hc_attn_scale"].dtype == torch.float32
    _, tensors, _ = fp8_hf
    assert tensors["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 1, 1)
    assert tensors["model.layers.1.self_attn.q_a_proj.weight_scale_inv"].shape == (1, 1)
    assert tensors["lm_head.weight_scale_inv"].shape == (3, 1)
    assert tensors["model.layers.1.attn_hc.scale"].dtype == torch.float32


@pytest.fixture(scope="module")
def fp8_models(fp8_original, fp8_hf):
    return {"original": load(fp8_original[0]), "hf": load(fp8_hf[0])}


@pytest.mark.parametrize("spelling", ["original", "hf"])
def test_fp8_weights_are_dequantized_exactly(spelling, fp8_models, fp8_original, fp8_hf):
    model = fp8_models[spelling]
    _, tensors, dequantized = {"original": fp8_original, "hf": fp8_hf}[spelling]
    for name, value in dequantized.items():
        assert torch.equal(param_of(model, name), value), name
    # and these differ from a plain fp8 -> float cast, so the scales were applied
    some = next(iter(dequantized))
    assert not torch.equal(tensors[some].float(), dequantized[some])


@pytest.fixture(scope="module")
def fp8_ref_logits(tmp_path_factory, saved, saved_tensors, fp8_original, fp8_hf, reference):
    """transformers' logits with its weights set to each checkpoint's dequantised values."""
    _, _, dequantized = fp8_original
    back = {to_original(k): k for k in saved_tensors}
    path = write_checkpoint(
        tmp_path_factory.mktemp("v4-fp8-original-dequantized"),
        saved,
        saved_tensors | {back[k]: v for k, v in dequantized.items()},
    )
    out = {"original": ref_logits_of(load_reference(path))}
    hf_model = copy.deepcopy(reference)
    with torch.no_grad():
        params = dict(hf_model.named_parameters())
        for k, v in fp8_hf[2].items():
            params[k].copy_(v)
    out["hf"] = ref_logits_of(hf_model)
    return out


@pytest.mark.parametrize("spelling", ["original", "hf"])
def test_fp8_logits_match_transformers(spelling, fp8_models, fp8_ref_logits, ref_logits):
    ours = our_logits(fp8_models[spelling])
    assert (ours - fp8_ref_logits[spelling]).abs().max() <= 1e-4
    assert (ours - ref_logits).abs().max() > 1e-3  # quantisation did change the model


def test_dequantize_fp8_blocks():
    g = torch.Generator().manual_seed(3)
    for shape in [(200, 300), (64, 32), (2, 200, 130), (128, 256)]:
        q = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
        nblocks = (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK))
        scale = torch.rand(nblocks, generator=g) + 0.1
        assert torch.equal(dequantize_fp8(q, scale), dequantize_blockwise(q, scale)), shape
    # UE8M0 (power-of-two) scales, as recent DeepSeek checkpoints ship them
    q = (torch.randn(200, 300, generator=g) * 50).to(torch.float8_e4m3fn)
    e8m0 = torch.tensor([[0.5, 2.0, 4.0], [0.25, 1.0, 8.0]]).to(torch.float8_e8m0fnu)
    assert torch.equal(dequantize_fp8(q, e8m0), dequantize_blockwise(q, e8m0.float()))
    # another block size, and a per-tensor scale
    assert torch.equal(
        dequantize_fp8(q, torch.ones(4, 3) * 2, (64, 128)),
        dequantize_blockwise(q, torch.ones(4, 3) * 2, (64, 128)),
    )
    assert torch.equal(dequantize_fp8(q, torch.tensor(3.0)), q.float() * 3)
    with pytest.raises(ModelLoadError, match=r"128x128 blocks need \(2, 3\)"):
        dequantize_fp8(q, torch.ones(4, 3))  # the old ceil(rows / scale rows) guess took this
    with pytest.raises(ModelLoadError, match="only FP8"):
        dequantize_fp8(q.float(), torch.ones(2, 3))


def test_is_scale(saved_tensors, original_tensors, hf_tensors):
    real = set(saved_tensors) | set(original_tensors) | set(hf_tensors)
    real |= {
        "layers.0.attn_hc.scale",
        "model.layers.3.ffn_hc.scale",
        "layers.0.hc_attn_scale",
        "layers.0.hc_ffn_scale",
        "hc_head_scale",
        "model.hc_head.hc_scale",
        "mtp.0.hc_head_scale",
        "mtp.0.attn_hc.scale",
        "mtp.0.hc_ffn_scale",
    }
    assert [k for k in real if is_scale(k)] == []
    scales = {
        "layers.0.attn.wq_a.scale": "layers.0.attn.wq_a.weight",
        "model.layers.0.ffn.experts.3.w2.scale": "model.layers.0.ffn.experts.3.w2.weight",
        "head.scale": "head.weight",
        "mtp.0.attn.wq_a.scale": "mtp.0.attn.wq_a.weight",
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj_scale_inv": "model.layers.0.mlp.experts.gate_up_proj",
    }
    for scale, weight in scales.items():
        assert is_scale(scale), scale
        assert weight_of_scale(scale) == weight


def test_scale_without_its_weight_is_a_load_error(tmp_path, saved, fp8_original, fp8_hf):
    tensors = dict(fp8_original[1])
    del tensors["layers.0.attn.wq_a.weight"]
    path = write_checkpoint(tmp_path / "a", saved, tensors)
    with pytest.raises(
        ModelLoadError, match=r"scales without their weight: layers\.0\.attn\.wq_a\.scale"
    ):
        load(path)
    tensors = dict(fp8_hf[1])
    del tensors["model.layers.1.mlp.experts.gate_up_proj"]
    path = write_checkpoint(tmp_path / "b", saved, tensors)
    with pytest.raises(
        ModelLoadError, match=r"without their weight: .*experts\.gate_up_proj_scale_inv"
    ):
        load(path)


def test_fp8_weight_without_its_scale_is_a_load_error(tmp_path, saved, fp8_original):
    tensors = dict(fp8_original[1])
    del tensors["layers.2.attn.wo_b.scale"]
    path = write_checkpoint(tmp_path / "ck", saved, tensors)
    with pytest.raises(
        ModelLoadError, match=r"FP8 tensor 'layers\.2\.attn\.wo_b\.weight' has no scale"
    ):
        load(path)


def test_scale_of_the_wrong_shape_is_a_load_error(tmp_path, saved, fp8_original):
    tensors = dict(fp8_original[1])
    tensors["head.scale"] = torch.ones(2, 1)
    path = write_checkpoint(tmp_path / "ck", saved, tensors)
    with pytest.raises(ModelLoadError, match=r"'head\.weight' has shape \(300, 64\) and a scale"):
        load(path)


# ---- 3. multi-token prediction -----------------------------------------------------------------


def mtp_tensors(original_tensors, hidden: int = 64, hc: int = 2) -> dict[str, torch.Tensor]:
    """`mtp.0.*` as DeepSeek ships them: its own embedding/hidden norms and projections, a head
    hyper-connection, and a full block (here a copy of layer 2, renamed)."""
    g = torch.Generator().manual_seed(7)
    out = {
        "mtp.0.enorm.weight": torch.rand(hidden, generator=g) + 0.5,
        "mtp.0.hnorm.weight": torch.rand(hidden, generator=g) + 0.5,
        "mtp.0.e_proj.weight": torch.randn(hidden, hidden, generator=g),
        "mtp.0.h_proj.weight": torch.randn(hidden, hidden, generator=g),
        "mtp.0.norm.weight": torch.rand(hidden, generator=g) + 0.5,
        "mtp.0.hc_head_fn": torch.randn(hc, hc * hidden, generator=g),
        "mtp.0.hc_head_base": torch.randn(hc, generator=g),
        "mtp.0.hc_head_scale": torch.rand(1, generator=g),
    }
    for k, v in original_tensors.items():
        if k.startswith("layers.2."):
            out["mtp.0." + k.removeprefix("layers.2.")] = v + 0.01
    return out


def test_mtp_tensors_are_kept(tmp_path, saved, original_tensors, spelling_logits):
    assert json.loads((saved / "config.json").read_text())["num_nextn_predict_layers"] == 1
    mtp = mtp_tensors(original_tensors)
    assert "mtp.0.attn.wq_a.weight" in mtp and "mtp.0.ffn.experts.3.w1.weight" in mtp
    model = load(write_checkpoint(tmp_path / "ck", saved, original_tensors, mtp))
    kept = mtp_weights(model.mtp)
    assert kept.keys() == mtp.keys()
    for k, v in mtp.items():
        assert torch.equal(kept[k], v), k
    assert torch.equal(our_logits(model), spelling_logits["original"])


def test_mtp_with_model_prefix_fp8_and_bf16(tmp_path, saved, saved_tensors, original_tensors):
    mtp = mtp_tensors(original_tensors)
    q, s = quantize(mtp["mtp.0.attn.wq_a.weight"])
    shipped = {"model." + k: v for k, v in mtp.items()}
    shipped["model.mtp.0.attn.wq_a.weight"], shipped["model.mtp.0.attn.wq_a.scale"] = q, s
    path = write_checkpoint(tmp_path / "ck", saved, saved_tensors, shipped)
    model = load(path, torch.bfloat16)
    kept = mtp_weights(model.mtp)
    assert kept.keys() == mtp.keys()  # no `model.` prefix, no `.scale` entry
    for k, v in mtp.items():  # as stored (float32 here), but the dequantised FP8 one
        if k != "mtp.0.attn.wq_a.weight":
            assert kept[k].dtype == torch.float32 and torch.equal(kept[k], v), k
    assert kept["mtp.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert torch.equal(kept["mtp.0.attn.wq_a.weight"], dequantize_blockwise(q, s).bfloat16())


def test_bf16_load_keeps_float32_parameters(saved, saved_tensors):
    """Norms, hyper-connections, sinks, position and router biases stay float32 (as in
    transformers' _keep_in_fp32_modules_strict); projections and experts take the dtype."""
    model = load(saved, torch.bfloat16)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    fp32 = re.compile(
        r".*(norm\.weight|_hc\.(fn|base|scale)|hc_head\.hc_\w+|sinks|position_bias"
        r"|e_score_correction_bias)"
    )
    for name, t in tensors.items():
        if name.endswith("tid2eid"):
            assert t.dtype == torch.long
        else:
            assert t.dtype == (torch.float32 if fp32.fullmatch(name) else torch.bfloat16), name
    assert torch.equal(tensors["layers.1.attn_hc.fn"], saved_tensors["model.layers.1.hc_attn_fn"])
    assert torch.equal(
        tensors["layers.2.self_attn.sinks"], saved_tensors["model.layers.2.attn.attn_sink"]
    )


# ---- 4. load errors ----------------------------------------------------------------------------


def test_missing_expert_part_is_named(tmp_path, saved, original_tensors, hf_tensors):
    tensors = dict(original_tensors)
    del tensors["layers.1.ffn.experts.2.w3.weight"]
    path = write_checkpoint(tmp_path / "a", saved, tensors)
    with pytest.raises(
        ModelLoadError,
        match=r"lacks tensors for: layers\.1\.mlp\.gate_up_proj\[expert 2 w3 \(up\)\]$",
    ):
        load(path)
    tensors = dict(hf_tensors)
    del tensors["model.layers.2.mlp.shared_experts.up_proj.weight"]
    path = write_checkpoint(tmp_path / "b", saved, tensors)
    with pytest.raises(
        ModelLoadError, match=r"layers\.2\.mlp\.shared_experts\.gate_up_proj\.weight\[w3 \(up\)\]"
    ):
        load(path)


def test_unknown_tensor_is_unexpected(tmp_path, saved, original_tensors):
    tensors = original_tensors | {"layers.0.attn.bogus.weight": torch.zeros(3)}
    path = write_checkpoint(tmp_path / "ck", saved, tensors)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'layers\.0\.attn\.bogus\.weight'"):
        load(path)


def test_two_spellings_of_one_tensor_are_an_error(tmp_path, saved, original_tensors, hf_tensors):
    tensors = original_tensors | {
        "model.layers.1.mlp.experts.gate_up_proj": hf_tensors[
            "model.layers.1.mlp.experts.gate_up_proj"
        ]
    }
    path = write_checkpoint(tmp_path / "ck", saved, tensors)
    with pytest.raises(ModelLoadError, match=r"both fill layers\.1\.mlp\.gate_up_proj\[expert"):
        load(path)
