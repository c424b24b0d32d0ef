"""Qwen-Image's LoRA key tables. Qwen-Image's original module names (ComfyUI's, and what musubi-tuner / ai-toolkit
files use) are diffusers' own: nothing is fused, so every Kohya module (``lora_unet_`` + the module path with
underscores) is one diffusers module of the transformer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from dreamstep.models.lora_keys import ModelKeys, ModuleMap, kohya_name
from dreamstep.models.qwen_image.configs import QWEN_IMAGE_TRANSFORMER

# The linear layers of ``transformer_blocks.{i}``.
QWEN_IMAGE_BLOCK: Final = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
    "attn.to_add_out", "img_mod.1", "txt_mod.1", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
# The linear layers outside the blocks.
QWEN_IMAGE_GLOBAL: Final = ("img_in", "txt_in", "proj_out", "norm_out.linear",
                            "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2")


def qwen_image_keys(transformer: Mapping | None = None) -> ModelKeys:
    """The tables of a transformer config (default: the released Qwen-Image's 60 blocks)."""
    blocks = {**QWEN_IMAGE_TRANSFORMER, **(transformer or {})}["num_layers"]
    modules = [f"transformer_blocks.{i}.{m}" for i in range(blocks) for m in QWEN_IMAGE_BLOCK] + list(QWEN_IMAGE_GLOBAL)
    maps = tuple(ModuleMap(kohya_name("lora_unet", m), (f"transformer.{m}",)) for m in modules)
    return ModelKeys("qwen-image", f"Qwen-Image transformer with {blocks} blocks", maps)


def keys_from_configs(configs: Mapping[str, Mapping]) -> ModelKeys:
    """The tables of the model whose component configs are ``configs`` (missing: the released model's)."""
    return qwen_image_keys(configs.get("transformer"))
