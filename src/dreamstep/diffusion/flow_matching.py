"""Rectified-flow (flow matching) training math for FLUX.1, as in the SD3 paper (arXiv 2403.03206).

With clean latents x, noise ε and σ ∈ [0, 1]:  x_σ = (1 - σ)·x + σ·ε, and the model predicts the
velocity  v = ε - x.  Timesteps are drawn by index into the scheduler's (shifted) σ table; the SD3
paper's non-uniform samplers (logit-normal, mode) and loss weightings (sigma_sqrt, cosmap) come from
diffusers' ``training_utils``.
"""

from __future__ import annotations

from typing import Literal

import torch
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

WeightingScheme = Literal["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"]


def sample_timestep_indices(
    scheme: WeightingScheme,
    batch_size: int,
    num_train_timesteps: int,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Indices into the scheduler's timestep/σ tables, shape (batch_size,), dtype long.

    ``logit_normal`` and ``mode`` sample non-uniformly (SD3 §3.1); the others sample uniformly.
    """
    u = compute_density_for_timestep_sampling(
        weighting_scheme=scheme, batch_size=batch_size, logit_mean=logit_mean, logit_std=logit_std,
        mode_scale=mode_scale, generator=generator,
    )
    # u can reach 1.0 exactly (mode sampling, float rounding): keep the index inside the table.
    return (u * num_train_timesteps).long().clamp_(0, num_train_timesteps - 1)


def sigmas_at(scheduler_sigmas: torch.Tensor, indices: torch.Tensor, ndim: int,
              device: torch.device | None = None) -> torch.Tensor:
    """σ for each sample, broadcastable to a latent of ``ndim`` dims: shape (B, 1, ..., 1), float32, on
    ``device`` (default: the indices'). Looked up where the table is: give indices drawn on the CPU, where
    :func:`sample_timestep_indices` draws them, and nothing waits for the device."""
    sigma = scheduler_sigmas.to(torch.float32)[indices.to(scheduler_sigmas.device)]
    return sigma.reshape(-1, *([1] * (ndim - 1))).to(device or indices.device, non_blocking=True)


def sigma_at_fraction(scheduler_sigmas: torch.Tensor, fraction: float) -> float:
    """σ of the table entry a uniform draw ``u = fraction`` selects (the index mapping of
    :func:`sample_timestep_indices`): a fixed noise level for validation."""
    index = min(int(fraction * len(scheduler_sigmas)), len(scheduler_sigmas) - 1)
    return float(scheduler_sigmas[index])


def noisy_latents(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x_σ = (1 - σ)·x + σ·ε."""
    return (1.0 - sigmas) * latents + sigmas * noise


def velocity_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching target v = ε - x."""
    return noise - latents


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, sigmas: torch.Tensor,
                 scheme: WeightingScheme) -> torch.Tensor:
    """Per-sample weighted MSE in float32, shape (B,).

    Each sample is weighted by its own σ, so instance and prior-preservation samples of one batch
    are weighted separately (the port tiles a full-batch weighting against half-batch predictions).
    """
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=scheme, sigmas=sigmas).float()
    per_element = weighting * (pred.float() - target.float()) ** 2
    return per_element.reshape(pred.shape[0], -1).mean(dim=1)


def instance_plus_prior_loss(per_sample: torch.Tensor, is_reg: torch.Tensor, prior_loss_weight: float) -> torch.Tensor:
    """DreamBooth with prior preservation: mean loss of the instance samples plus ``prior_loss_weight``
    times the mean loss of the class (regularization) samples; a part absent from the batch adds 0.
    ``is_reg`` is read on the CPU: a CPU mask (as the data loader gives it) costs no wait for the device."""
    is_reg = is_reg.cpu()
    prior = is_reg.nonzero().flatten()
    if not len(prior):
        return per_sample.mean()
    instance = (~is_reg).nonzero().flatten().to(per_sample.device, non_blocking=True)
    loss = per_sample.new_zeros(())
    if len(instance):
        loss = loss + per_sample.index_select(0, instance).mean()
    prior = prior.to(per_sample.device, non_blocking=True)
    loss = loss + prior_loss_weight * per_sample.index_select(0, prior).mean()
    return loss
