"""SDXL on the meta device: its components for the memory plan, the UNet's training pass as the trainer calls it,
and the full-size parts whose weight shapes check a LoRA file."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from dreamstep.models import memory_plan as mp
from dreamstep.models import published_configs as published

TEXT_TOKENS = 77  # both CLIP encoders read 77 tokens


def meta_components(folder: Path | None) -> dict[str, nn.Module]:
    """The SDXL components on the meta device, from ``folder``'s configs or SDXL base 1.0's."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    return mp.components_on_meta(folder, {
        "unet": (UNet2DConditionModel, published.SDXL_UNET),
        "text_encoder": (CLIPTextModel, published.CLIP_L_TEXT),
        "text_encoder_2": (CLIPTextModelWithProjection, published.OPENCLIP_BIGG_TEXT),
        "vae": (AutoencoderKL, published.SDXL_VAE),
    })


def training_pass(unet: nn.Module, *, resolution: int, batch: int, train: bool = True
                  ) -> Callable[[], torch.Tensor | None]:
    """One forward of the UNet on a ``resolution`` px latent with SDXL's size conditioning (fp32 sizes), the latents
    and embeddings in the UNet's dtype (the trainer casts its cached ones so), returning a loss when ``train``."""
    config = unet.config
    side = resolution // 8

    def run() -> torch.Tensor | None:
        dtype = mp.input_dtype(unet)
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        out = unet(torch.empty(batch, config.in_channels, side, side, dtype=dtype), torch.empty(batch),
                   encoder_hidden_states=torch.empty(batch, TEXT_TOKENS, config.cross_attention_dim, dtype=dtype),
                   added_cond_kwargs={"text_embeds": torch.empty(batch, pooled, dtype=dtype),
                                      "time_ids": torch.empty(batch, 6)}, return_dict=False)[0]
        return (out.float() - torch.empty_like(out, dtype=torch.float32)).pow(2).mean() if train else None

    return run


def released_components(configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
    """The UNet and both CLIP text encoders built empty from ``configs``."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    def clean(config: Mapping) -> dict:
        return {k: v for k, v in config.items() if not k.startswith("_")}

    with init_empty_weights():
        return {"unet": UNet2DConditionModel.from_config(clean(configs["unet"])),
                "text_encoder": CLIPTextModel(CLIPTextConfig(**clean(configs["text_encoder"]))),
                "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**clean(configs["text_encoder_2"])))}
