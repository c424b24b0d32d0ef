"""Krea 2 plumbing: the Qwen-Image VAE's posterior in the transformer's latent units, caption features through
diffusers' own ``Krea2Pipeline.encode_prompt`` (its system prompt, the selected layers' hidden states, a fixed
length with a mask), and the training σ table."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import Krea2Pipeline


def latent_normalization(vae: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and 1/std (1, C, 1, 1) of the VAE's latents: the transformer reads (z - mean) / std."""
    channels = vae.config.z_dim
    return (torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1),
            1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1))


def encode_posterior(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1], (B, 3, H, W) -> the posterior's mean and std in the transformer's units, (B, 2C, H/8,
    W/8), float32 (the VAE's single frame axis dropped)."""
    posterior = vae.encode(pixels.unsqueeze(2).to(vae.device, vae.dtype)).latent_dist
    mean, inverse_std = (t.to(pixels.device) for t in latent_normalization(vae))
    return torch.cat([(posterior.mean.float().squeeze(2) - mean) * inverse_std,
                      posterior.std.float().squeeze(2) * inverse_std], dim=1)


@torch.no_grad()
def encode_prompts(pipeline: Krea2Pipeline, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The caption features ``Krea2Pipeline.encode_prompt`` makes: ``prompt_embeds`` (B, S, L, D) fp32 on the CPU
    and ``prompt_mask`` (B, S), for a fixed S."""
    embeds, mask = pipeline.encode_prompt(prompt=list(prompts), device=pipeline.text_encoder.device,
                                          max_sequence_length=max_sequence_length)
    return {"prompt_embeds": embeds.float().cpu(), "prompt_mask": mask.cpu()}


def training_sigmas(scheduler: Any) -> torch.Tensor:
    """The σ table of training, (num_train_timesteps,): a fresh scheduler's, unshifted with Krea 2's dynamic
    shifting, as the script reads it."""
    fresh = type(scheduler).from_config(scheduler.config)
    return fresh.sigmas[:fresh.config.num_train_timesteps].clone()
