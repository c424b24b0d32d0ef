"""VAE posteriors for the latent caches, shared by every trainer.

The cache holds the posterior's mean and std (not one sample), so a cached run draws a fresh latent
each step exactly as an uncached one does.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def encode_posterior(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1], (B, 3, H, W) -> the posterior's mean and std in the model's latent units
    ((z - shift) · scale; SDXL has no shift, FLUX.2's VAE neither): (B, 2C, H/f, W/f), float32."""
    posterior = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    scale = getattr(vae.config, "scaling_factor", 1.0)
    return torch.cat([(posterior.mean.float() - shift) * scale, posterior.std.float() * scale], dim=1)


def sample_latents(latent_dist: torch.Tensor) -> torch.Tensor:
    """One latent sample x = μ + σ·n from (B, 2C, h, w) mean and std: (B, C, h, w). n is drawn in the contiguous
    order diffusers' ``latent_dist.sample()`` draws it, whatever the memory layout of the posterior (a VAE output
    is not contiguous, a cached one is): the same seed gives the same sample either way."""
    mean, std = latent_dist.chunk(2, dim=1)
    return mean + std * torch.randn(mean.shape, dtype=mean.dtype, device=mean.device)


def posterior_mean(latent_dist: torch.Tensor) -> torch.Tensor:
    """The posterior's mean from (B, 2C, h, w) mean and std: (B, C, h, w); deterministic, for validation."""
    return latent_dist.chunk(2, dim=1)[0]
