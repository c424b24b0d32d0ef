"""FLUX.1 plumbing shared by the trainers: latent packing, position ids, VAE posteriors and prompt
encoding, all through diffusers' own ``FluxPipeline`` helpers so the layout matches inference exactly.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FluxPipeline


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 · w/2, 4C): FLUX sees 2x2 latent patches as tokens."""
    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, h/2 · w/2, 4C) -> (B, C, h, w) for a latent of ``height`` x ``width``."""
    # diffusers' helper takes pixel sizes and a VAE factor; factor 1 makes it work in latent units.
    return FluxPipeline._unpack_latents(tokens, height, width, vae_scale_factor=1)


def latent_image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Rotary position ids of the packed latent tokens: (h/2 · w/2, 3)."""
    return FluxPipeline._prepare_latent_image_ids(1, height // 2, width // 2, device, dtype)


@torch.no_grad()
def encode_posterior(vae: AutoencoderKL, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1], (B, 3, H, W) -> the posterior's mean and std, shifted and scaled like FLUX's
    latents: (B, 2C, H/f, W/f). Caching the distribution (not one sample) keeps a fresh sample per step."""
    posterior = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
    shift = vae.config.shift_factor or 0.0
    scale = vae.config.scaling_factor
    mean = (posterior.mean.float() - shift) * scale
    std = posterior.std.float() * scale
    return torch.cat([mean, std], dim=1)


@torch.no_grad()
def encode_prompts(pipeline: FluxPipeline, prompts: list[str], max_sequence_length: int
                   ) -> dict[str, torch.Tensor]:
    """T5 sequence embeddings (B, S, D) and CLIP pooled embeddings (B, P) for each prompt."""
    prompt_embeds, pooled, _ = pipeline.encode_prompt(prompt=prompts, prompt_2=prompts,
                                                      device=pipeline.text_encoder.device,
                                                      max_sequence_length=max_sequence_length)
    return {"prompt_embeds": prompt_embeds.float().cpu(), "pooled": pooled.float().cpu()}


def clip_input_ids(pipeline: FluxPipeline, prompts: list[str]) -> torch.Tensor:
    """CLIP token ids (B, 77), padded and truncated exactly as ``FluxPipeline`` does at inference."""
    return pipeline.tokenizer(prompts, padding="max_length", max_length=pipeline.tokenizer_max_length,
                              truncation=True, return_tensors="pt").input_ids


def text_ids(sequence_length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Position ids of the text tokens: all zero, (S, 3), as in ``FluxPipeline.encode_prompt``."""
    return torch.zeros(sequence_length, 3, device=device, dtype=dtype)
