"""SDXL's LoRA key tables: sd-scripts' UNet names are the original (SGM) module paths
(``input_blocks.4.1...``, :mod:`dreamstep.models.sdxl.sgm_keys`); the text encoders keep their Hugging Face
names under ``lora_te1`` (CLIP-L) and ``lora_te2`` (OpenCLIP bigG)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from dreamstep.models.lora_keys import CLIP_LAYER, ModelKeys, ModuleMap, kohya_name, text_encoder_maps
from dreamstep.models.published_configs import SDXL_UNET
from dreamstep.models.sdxl.sgm_keys import unet_module_map

SDXL_CLIP_LAYERS: Final = {"text_encoder": 12, "text_encoder_2": 32}


def sdxl_keys(unet: Mapping | None = None, clip_layers: int = SDXL_CLIP_LAYERS["text_encoder"],
              clip_g_layers: int = SDXL_CLIP_LAYERS["text_encoder_2"]) -> ModelKeys:
    """The SDXL tables for a UNet config (default: stable-diffusion-xl-base-1.0)."""
    cfg = dict(unet or SDXL_UNET)
    maps = [ModuleMap(kohya_name("lora_unet", sgm), (f"unet.{ours}",))
            for ours, sgm in unet_module_map(cfg).items()]
    maps += text_encoder_maps("lora_te1", "text_encoder", CLIP_LAYER, clip_layers)
    maps += text_encoder_maps("lora_te2", "text_encoder_2", CLIP_LAYER, clip_g_layers)
    desc = f"SDXL UNet with block widths {tuple(cfg['block_out_channels'])}"
    return ModelKeys("sdxl", desc, tuple(maps))


def keys_from_configs(configs: Mapping[str, Mapping]) -> ModelKeys:
    """The tables of the model whose component configs are ``configs`` (missing ones: the released model's)."""
    return sdxl_keys(configs.get("unet"),
                     configs.get("text_encoder", {}).get("num_hidden_layers", SDXL_CLIP_LAYERS["text_encoder"]),
                     configs.get("text_encoder_2", {}).get("num_hidden_layers", SDXL_CLIP_LAYERS["text_encoder_2"]))
