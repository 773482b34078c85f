"""LLaVA: a CLIP vision tower and a two-layer projector in front of a dense language model; the
image embeddings replace the prompt's image placeholder tokens.

The vision tower is transformers' own CLIP module (called, not re-implemented); the language
model is our dense family, so its KV, graphs and prefix cache are the dense ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from daemon.kv.spec import KVGroup
from daemon.models.attention import AttentionBatch, PagedKVCache
from daemon.models.compiled import CompiledDecode
from daemon.models.dense import DenseConfig, DenseForCausalLM
from daemon.models.graphs import PagedDecodeGraphs

VISION_TYPES = ("clip_vision_model",)
PROJECTOR_ACTS = {"gelu": nn.GELU, "gelu_pytorch_tanh": lambda: nn.GELU("tanh"), "silu": nn.SiLU}


@dataclass
class LlavaConfig:
    text: DenseConfig
    vision: dict[str, Any]  # the vision tower's Hugging Face config
    image_token_id: int
    feature_layer: int  # the vision tower's hidden state the projector reads
    keep_cls: bool  # vision_feature_select_strategy "full" (else "default": patches only)
    projector_act: str
    projector_bias: bool

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> LlavaConfig:
        vision = dict(c.get("vision_config") or {})
        if vision.get("model_type") not in VISION_TYPES:
            raise ValueError(f"vision tower {vision.get('model_type')!r} is not supported")
        layer = c.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError("a list of vision_feature_layer values is not supported")
        strategy = c.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        act = c.get("projector_hidden_act", "gelu")
        if act not in PROJECTOR_ACTS:
            raise ValueError(f"projector_hidden_act {act!r} is not supported")
        token = c.get("image_token_id", c.get("image_token_index"))
        if not isinstance(token, int):
            raise ValueError("the config names no image_token_index")
        return cls(
            text=DenseConfig.from_hf(c["text_config"]),
            vision=vision,
            image_token_id=token,
            feature_layer=layer,
            keep_cls=strategy == "full",
            projector_act=act,
            projector_bias=c.get("multimodal_projector_bias", True),
        )

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens per image, as transformers' LlavaProcessor expands them."""
        side = self.vision["image_size"] // self.vision["patch_size"]
        return side * side + (1 if self.keep_cls else 0)


class Projector(nn.Module):
    def __init__(self, cfg: LlavaConfig) -> None:
        super().__init__()
        hidden, vision = cfg.text.hidden_size, cfg.vision["hidden_size"]
        self.linear_1 = nn.Linear(vision, hidden, bias=cfg.projector_bias)
        self.act = PROJECTOR_ACTS[cfg.projector_act]()
        self.linear_2 = nn.Linear(hidden, hidden, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, cfg: LlavaConfig, device: torch.device) -> None:
        super().__init__()
        from transformers import CLIPVisionConfig, CLIPVisionModel

        self.cfg = cfg
        self.language_model = DenseForCausalLM(cfg.text, device)
        vision_cfg = CLIPVisionConfig(**{k: v for k, v in cfg.vision.items() if k != "model_type"})
        self.vision_tower = CLIPVisionModel(vision_cfg)
        self.multi_modal_projector = Projector(cfg)

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def image_tokens(self) -> int:
        return self.cfg.image_tokens

    @property
    def hidden_size(self) -> int:
        return self.cfg.text.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.language_model.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.language_model.max_model_len

    @property
    def num_layers(self) -> int:
        return self.language_model.num_layers

    def after_load(self) -> None:
        """Buffers that no checkpoint holds (built on the meta device, then left empty); the
        language model's own step after its weights are in."""
        self.language_model.after_load()
        emb = self.vision_tower.embeddings
        n = emb.position_ids.shape[-1]
        emb.position_ids.copy_(torch.arange(n, device=emb.position_ids.device).view(1, -1))

    def kv_groups(self, dtype: torch.dtype, block_size: int) -> list[KVGroup]:
        return self.language_model.kv_groups(dtype, block_size)

    def allocate_cache(
        self,
        groups: list[KVGroup],
        num_blocks: list[int],
        device: torch.device,
        graph_batch: int = 0,
    ) -> PagedKVCache:
        return self.language_model.allocate_cache(groups, num_blocks, device, graph_batch)

    def decode_graphs(
        self, cache: PagedKVCache, device: torch.device, max_batch: int
    ) -> PagedDecodeGraphs | CompiledDecode:
        # decodes never carry images: the language model's own graphs
        return self.language_model.decode_graphs(cache, device, max_batch)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, image_tokens, hidden] embeddings of preprocessed images [images, 3, H, W]."""
        tower = self.vision_tower
        like = tower.embeddings.patch_embedding.weight
        out = tower(pixel_values.to(like), output_hidden_states=True, return_dict=True)
        features = out.hidden_states[self.cfg.feature_layer]
        if not self.cfg.keep_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, batch, cache)

    def forward_spliced(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
        rows: torch.Tensor,
        embeds: torch.Tensor,
    ) -> torch.Tensor:
        """The forward with the token embeddings of `rows` replaced by `embeds` (image rows)."""
        lm = self.language_model
        x = lm.embed_tokens(input_ids)
        x[rows] = embeds.to(x.dtype)
        return lm.forward_embedded(x, positions, batch, cache, lm.num_layers)

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
        num_layers: int,
    ) -> torch.Tensor:
        return self.language_model.forward_layers(input_ids, positions, batch, cache, num_layers)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, upcast)

    def checkpoint_to_param(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith("model."):
            name = name[len("model.") :]
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return name, None
        if name.startswith("language_model."):
            name = name[len("language_model.") :]
        target = self.language_model.checkpoint_to_param(name)
        if target is None:
            return None
        return "language_model." + target[0], target[1]

    def _split(self, param: str) -> str | None:
        prefix = "language_model."
        return param[len(prefix) :] if param.startswith(prefix) else None

    def param_parts(self, param: str) -> list[int | None]:
        if param.endswith("embeddings.position_ids"):
            return []  # made by after_load
        inner = self._split(param)
        return self.language_model.param_parts(inner) if inner is not None else [None]

    def param_view(self, name: str, param: torch.Tensor, part: int | None) -> torch.Tensor:
        inner = self._split(name)
        if inner is None:
            return param
        return self.language_model.param_view(inner, param, part)

    def covered_parts(self, param: str, part: int | None) -> list[int | None]:
        return [part]
