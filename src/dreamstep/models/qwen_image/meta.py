"""Qwen-Image on the meta device: its components for the memory plan, the transformer's training pass as the trainers
call it, and the full-size transformer whose weight shapes check a LoRA file."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dreamstep.models import memory_plan as mp
from dreamstep.models.qwen_image.configs import QWEN2_5_VL_7B, QWEN_IMAGE_TRANSFORMER, QWEN_IMAGE_VAE


def meta_components(folder: Path | None) -> dict[str, nn.Module]:
    """The Qwen-Image components on the meta device, from ``folder``'s configs or Qwen-Image's."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    components = mp.components_on_meta(folder, {
        "transformer": (QwenImageTransformer2DModel, QWEN_IMAGE_TRANSFORMER),
        "text_encoder": (Qwen2_5_VLForConditionalGeneration, QWEN2_5_VL_7B),
        "vae": (AutoencoderKLQwenImage, QWEN_IMAGE_VAE),
    })
    return {**components, "vae": ImageVae(components["vae"])}


class ImageVae(nn.Module):
    """Qwen-Image's video VAE as the memory plan's image-VAE pass calls a VAE (:mod:`dreamstep.models.plans`): 4-D
    pixels and latents, read and written as one frame, and the config fields that pass reads (its 8x factor as
    four levels, the latent channels, no shift or scale: the trainer normalises per channel, which costs nothing
    here)."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        levels = int(math.log2(vae.spatial_compression_ratio)) + 1
        self.config = SimpleNamespace(block_out_channels=(0,) * levels, latent_channels=vae.config.z_dim,
                                      in_channels=3, shift_factor=0.0, scaling_factor=1.0)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def encode(self, pixels: torch.Tensor) -> Any:
        return self.vae.encode(pixels.unsqueeze(2))

    def decode(self, latents: torch.Tensor) -> Any:
        return self.vae.decode(latents.unsqueeze(2))


def training_pass(transformer: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool = True,
                  image_token_multiplier: int = 1) -> Callable[[], torch.Tensor | None]:
    """One forward of the transformer at ``resolution`` (2x2 patches of the 8x latent: a 1024 px image is 64 x 64
    tokens, times ``image_token_multiplier`` for Edit's reference images of the target's size), returning a loss
    when ``train``: the inputs in the transformer's dtype (the trainer casts its cached latents and embeddings; σ
    in fp32) under autocast, or the pipeline's."""
    side = resolution // 16
    shapes = [[(1, side, side)] * image_token_multiplier] * batch

    def run() -> torch.Tensor | None:
        dtype = mp.input_dtype(transformer)
        out = transformer(
            hidden_states=torch.empty(batch, side * side * image_token_multiplier, transformer.config.in_channels,
                                      dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text_tokens, transformer.config.joint_attention_dim, dtype=dtype),
            encoder_hidden_states_mask=None, timestep=torch.empty(batch, dtype=torch.float32 if train else dtype),
            img_shapes=shapes, return_dict=False)[0]
        if not train:
            return None
        target = out[:, :side * side].float()
        return (target - torch.empty_like(target)).pow(2).mean()

    return run


def released_components(configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
    """The transformer built empty from ``configs`` (a LoRA adapts nothing else)."""
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    with init_empty_weights():
        config = {k: v for k, v in configs["transformer"].items() if not k.startswith("_")}
        return {"transformer": QwenImageTransformer2DModel.from_config(config)}
