"""The released FLUX.1-dev and SDXL base 1.0 architectures, built on the meta device: every layer's weight
shape without a byte of weights or a download, for checking that a LoRA fits the model it names.

The text-encoder configs are those of the released checkpoints (CLIP ViT-L/14, T5-XXL v1.1, OpenCLIP
ViT-bigG/14); the FLUX transformer's are diffusers' defaults, which are FLUX.1's, with guidance
embedding as in FLUX.1-dev; the SDXL UNet's come from :data:`dreamstep.models.published_configs.SDXL_UNET`.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from dreamstep.models.published_configs import SDXL_UNET

CLIP_L: dict = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                "projection_dim": 768, "hidden_act": "quick_gelu", "max_position_embeddings": 77, "vocab_size": 49408}
CLIP_BIG_G: dict = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                    "num_attention_heads": 20, "projection_dim": 1280, "hidden_act": "gelu",
                    "max_position_embeddings": 77, "vocab_size": 49408}
T5_XXL: dict = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
                "feed_forward_proj": "gated-gelu", "vocab_size": 32128}
FLUX_DEV_TRANSFORMER: dict = {"guidance_embeds": True}
RELEASED_NAMES = {"flux": "FLUX.1-dev", "sdxl": "SDXL base 1.0"}
RELEASED_SHAPES_FILE = Path(__file__).with_name("released_shapes.json.gz")

# transformers >= 5 builds CLIPTextModel without its 'text_model.' level; LoRA files name it either way.
_FLAT_CLIP = re.compile(r"^(text_encoder(?:_2)?)\.encoder\.layers\.")


def with_text_model(name: str) -> str:
    """A diffusers-layout CLIP module name in the form every loader maps
    (``text_encoder.text_model.encoder.layers…``), whichever transformers version named it."""
    return _FLAT_CLIP.sub(r"\1.text_model.encoder.layers.", name)


def _build(model: str, configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    def clean(config: Mapping) -> dict:
        return {k: v for k, v in config.items() if not k.startswith("_")}

    with init_empty_weights():
        if model == "flux":
            return {"transformer": FluxTransformer2DModel.from_config(clean(configs["transformer"])),
                    "text_encoder": CLIPTextModel(CLIPTextConfig(**clean(configs["text_encoder"]))),
                    "text_encoder_2": T5EncoderModel(T5Config(**clean(configs["text_encoder_2"])))}
        return {"unet": UNet2DConditionModel.from_config(clean(configs["unet"])),
                "text_encoder": CLIPTextModel(CLIPTextConfig(**clean(configs["text_encoder"]))),
                "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**clean(configs["text_encoder_2"])))}


def released_configs(model: str) -> dict[str, dict]:
    """Component configs of FLUX.1-dev ('flux') or SDXL base 1.0 ('sdxl')."""
    if model == "flux":
        return {"transformer": FLUX_DEV_TRANSFORMER, "text_encoder": CLIP_L, "text_encoder_2": T5_XXL}
    return {"unet": SDXL_UNET, "text_encoder": CLIP_L, "text_encoder_2": CLIP_BIG_G}


def weight_shapes(model: str, configs: Mapping[str, Mapping] | None = None) -> dict[str, tuple[int, ...]]:
    """``{diffusers module name: weight shape}`` of every Linear and Conv2d of the model's trainable
    components (e.g. ``transformer.transformer_blocks.0.attn.to_q``: (3072, 3072)), built on the meta
    device from ``configs`` (a pipeline folder's component configs) or, without them, the released model's."""
    if configs is None:
        return dict(_released_shapes(model))
    merged = {**released_configs(model), **{k: v for k, v in configs.items() if k in released_configs(model)}}
    return _shapes(_build(model, merged))


@lru_cache(maxsize=2)
def _released_shapes(model: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """From the table shipped beside this module: building FLUX.1-dev with T5-XXL on the meta device takes
    seconds, and ``lora info`` should answer in less. ``tests/models`` checks the table against the build;
    :func:`write_released_shapes` makes it again."""
    with gzip.open(RELEASED_SHAPES_FILE, "rt", encoding="utf-8") as f:
        table = json.load(f)[model]
    return tuple((name, tuple(shape)) for name, shape in table.items())


def built_released_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """The released model's shapes as the meta-device build gives them (what the shipped table must hold)."""
    return _shapes(_build(model, released_configs(model)))


def write_released_shapes(path: Path = RELEASED_SHAPES_FILE) -> None:
    table = {model: built_released_shapes(model) for model in RELEASED_NAMES}
    path.write_bytes(gzip.compress(json.dumps(table, separators=(",", ":")).encode(), mtime=0))


def _shapes(components: Mapping[str, nn.Module]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for component, module in components.items():
        for name, layer in module.named_modules():
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                shapes[with_text_model(f"{component}.{name}")] = tuple(layer.weight.shape)
    return shapes


def lora_shape_problem(name: str, down: torch.Tensor, up: torch.Tensor,
                       shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why a LoRA module (diffusers name, down (rank, in[, kh, kw]), up (out, rank[, 1, 1])) does not fit the
    layer of that name, or None when it does."""
    weight = shapes.get(name)
    if weight is None:
        return f"module '{name}' does not exist"
    if tuple(down.shape[1:]) != weight[1:]:
        return (f"module '{name}' takes inputs of shape {tuple(down.shape[1:])} (lora_down {tuple(down.shape)}), "
                f"the layer takes {weight[1:]}")
    if up.shape[0] != weight[0]:
        return f"module '{name}' has {up.shape[0]} outputs (lora_up {tuple(up.shape)}), the layer has {weight[0]}"
    return None
