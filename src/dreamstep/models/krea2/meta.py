"""Krea 2 on the meta device: its components for the memory plan, the transformer's training pass as the trainer
calls it, and the full-size parts whose weight shapes check a LoRA file."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dreamstep.models import memory_plan as mp
from dreamstep.models.krea2 import configs


def meta_components(folder: Path | None) -> dict[str, nn.Module]:
    """The components on the meta device, from ``folder``'s configs or the released model's; the VAE as the plan's
    image passes call an image VAE (:class:`FrameVae`)."""
    from diffusers import AutoencoderKLQwenImage, Krea2Transformer2DModel
    from transformers import Qwen3VLModel

    parts = mp.components_on_meta(folder, {
        "transformer": (Krea2Transformer2DModel, configs.TRANSFORMER),
        "text_encoder": (Qwen3VLModel, dict(configs.TEXT_ENCODER)),
        "vae": (AutoencoderKLQwenImage, configs.VAE),
    })
    return {**parts, "vae": FrameVae(parts["vae"])}


class FrameVae(nn.Module):
    """Qwen-Image's video VAE seen as an image VAE, for the memory plan's encode and decode passes: images (B, C,
    H, W) in, a frame axis of one added and dropped around its calls, as the trainer and the pipeline do."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.config = SimpleNamespace(block_out_channels=[0] * (1 + len(vae.config.temperal_downsample)),
                                      latent_channels=vae.config.z_dim, in_channels=3, shift_factor=0.0,
                                      scaling_factor=1.0)

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    @property
    def device(self) -> torch.device:
        return self.vae.device

    def encode(self, pixels: torch.Tensor) -> Any:
        posterior = self.vae.encode(pixels.unsqueeze(2)).latent_dist
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=posterior.mean.squeeze(2),
                                                           std=posterior.std.squeeze(2)))

    def decode(self, latents: torch.Tensor) -> Any:
        return self.vae.decode(latents.unsqueeze(2))


def training_pass(transformer: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool = True,
                  image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                  ) -> Callable[[], torch.Tensor | None]:
    """One forward of the transformer at ``resolution`` (8x VAE, 2x2 patches) with ``text_tokens`` caption tokens
    of the selected layers' features in the transformer's dtype (σ in fp32 when ``train``, as the trainer gives it),
    returning a loss when ``train``."""
    config = transformer.config
    tokens = (resolution // 16) ** 2 * image_token_multiplier

    def run() -> torch.Tensor | None:
        dtype = mp.input_dtype(transformer)
        out = transformer(
            hidden_states=torch.empty(batch, tokens, config.in_channels, dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text_tokens, config.num_text_layers, config.text_hidden_dim,
                                              dtype=dtype),
            timestep=torch.empty(batch, dtype=torch.float32 if train else dtype),
            position_ids=torch.empty(text_tokens + tokens, 3),
            encoder_attention_mask=torch.empty(batch, text_tokens, dtype=torch.bool), return_dict=False)[0]
        return (out.float() - torch.empty_like(out, dtype=torch.float32)).pow(2).mean() if train else None

    return run


def released_components(configs_: Mapping[str, Mapping]) -> dict[str, nn.Module]:
    """The transformer built empty from ``configs_`` (the text encoder is never adapted)."""
    from accelerate import init_empty_weights
    from diffusers import Krea2Transformer2DModel

    with init_empty_weights():
        transformer = Krea2Transformer2DModel.from_config(
            {k: v for k, v in configs_["transformer"].items() if not k.startswith("_")})
    return {"transformer": transformer}
