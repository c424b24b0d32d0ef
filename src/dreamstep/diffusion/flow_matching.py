"""Rectified-flow (flow matching) training math for FLUX.1, as in the SD3 paper (arXiv 2403.03206).

With clean latents x, noise ε and σ ∈ [0, 1]:  x_σ = (1 - σ)·x + σ·ε, and the model predicts the
velocity  v = ε - x.  Timesteps are drawn by index into the scheduler's (shifted) σ table; the SD3
paper's non-uniform samplers (logit-normal, mode) and loss weightings (sigma_sqrt, cosmap) come from
diffusers' ``training_utils``.

sd-scripts' FLUX trainer (``library/flux_train_utils.py``) adds its own σ samplers and ways to read the
prediction, here under its names: ``--timestep_sampling sigma|uniform|sigmoid|shift|flux_shift`` with
``--sigmoid_scale`` and ``--discrete_flow_shift`` (:func:`sample_sigmas`), and ``--model_prediction_type
raw|additive|sigma_scaled`` (:func:`apply_model_prediction_type`). :class:`FlowMatchingObjective` holds one
trainer's choice of all of these and the loss (:mod:`dreamstep.diffusion.losses`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from dreamstep.diffusion.losses import LossFunction

WeightingScheme = Literal["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"]
TimestepSampling = Literal["sigma", "uniform", "sigmoid", "shift", "flux_shift"]
ModelPredictionType = Literal["raw", "additive", "sigma_scaled"]


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


def time_shift(mu: float, sigma: float, t: torch.Tensor) -> torch.Tensor:
    """FLUX.1's resolution-dependent shift of σ: e^μ / (e^μ + (1/t - 1)^sigma)."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def linear_function(x1: float = 256, y1: float = 0.5, x2: float = 4096, y2: float = 1.15) -> Callable[[float], float]:
    """The line through (x1, y1) and (x2, y2): FLUX.1's μ of an image of x packed tokens (0.5 at 256, 1.15
    at 4096), sd-scripts' ``get_lin_function``."""
    slope = (y2 - y1) / (x2 - x1)
    return lambda x: slope * x + y1 - slope * x1


def sample_sigmas(sampling: TimestepSampling, batch_size: int, latent_size: tuple[int, int], *,
                  sigmoid_scale: float = 1.0, discrete_flow_shift: float = 3.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """σ of each sample, (batch_size,), float32 on the CPU, drawn as sd-scripts'
    ``get_noisy_model_input_and_timesteps`` draws it for every method but ``sigma`` (which indexes a σ table:
    :func:`sample_timestep_indices`). ``latent_size`` is the unpacked latent's (h, w).

    - ``uniform``: σ ~ U(0, 1);
    - ``sigmoid``: σ = sigmoid(s·n), n ~ N(0, 1), s = ``sigmoid_scale`` (x-flux);
    - ``shift``: σ' = sigmoid(s·n), then σ = k·σ' / (1 + (k - 1)·σ') with k = ``discrete_flow_shift``;
    - ``flux_shift``: σ' = sigmoid(s·n), then σ = time_shift(μ, 1, σ') with μ from the image's packed
      token count (h/2)·(w/2), as FLUX.1's sampler shifts its schedule.
    """
    if sampling == "uniform":
        return torch.rand((batch_size,), generator=generator)
    if sampling not in ("sigmoid", "shift", "flux_shift"):
        raise ValueError(f"timestep sampling {sampling!r} draws no σ directly; use sample_timestep_indices")
    sigmas = torch.sigmoid(sigmoid_scale * torch.randn((batch_size,), generator=generator))
    if sampling == "shift":
        return (sigmas * discrete_flow_shift) / (1 + (discrete_flow_shift - 1) * sigmas)
    if sampling == "flux_shift":
        height, width = latent_size
        return time_shift(linear_function()((height // 2) * (width // 2)), 1.0, sigmas)
    return sigmas


def apply_model_prediction_type(prediction_type: ModelPredictionType, prediction: torch.Tensor,
                                noisy_input: torch.Tensor, sigmas: torch.Tensor,
                                weighting_scheme: WeightingScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sd-scripts' reading of the transformer's output before the loss, and the loss weighting that goes with
    it: ``raw`` the output as is; ``additive`` output + x_σ; ``sigma_scaled`` x_σ - σ·output, weighted by
    ``weighting_scheme`` (SD3 §3.1). sd-scripts scores all three against v = ε - x. The weighting is ``None``
    (unweighted) for the first two."""
    if prediction_type == "raw":
        return prediction, None
    if prediction_type == "additive":
        return prediction + noisy_input, None
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas).float()
    return prediction * (-sigmas) + noisy_input, weighting


@dataclass(frozen=True)
class FlowMatchingObjective:
    """How a FLUX trainer draws σ and scores the prediction. ``timestep_sampling="sigma"`` draws an index into
    the σ table by ``weighting_scheme``'s density (diffusers' and sd-scripts' default); the other methods
    draw σ directly (:func:`sample_sigmas`). ``model_prediction_type=None`` is diffusers' scripts' reading:
    the raw output, weighted by ``weighting_scheme`` at every σ; a type is sd-scripts' reading
    (:func:`apply_model_prediction_type`)."""

    weighting_scheme: WeightingScheme = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    timestep_sampling: TimestepSampling = "sigma"
    sigmoid_scale: float = 1.0
    discrete_flow_shift: float = 3.0
    model_prediction_type: ModelPredictionType | None = None
    loss: LossFunction = field(default_factory=LossFunction)

    def sample(self, sigma_table: torch.Tensor, batch_size: int, latent_size: tuple[int, int],
               device: torch.device) -> torch.Tensor:
        """σ of each sample, (B, 1, 1, 1), float32 on ``device``, drawn on the CPU (no wait for the device)."""
        if self.timestep_sampling == "sigma":
            indices = sample_timestep_indices(self.weighting_scheme, batch_size, len(sigma_table),
                                              logit_mean=self.logit_mean, logit_std=self.logit_std,
                                              mode_scale=self.mode_scale)
            return sigmas_at(sigma_table, indices, 4, device)
        sigmas = sample_sigmas(self.timestep_sampling, batch_size, latent_size, sigmoid_scale=self.sigmoid_scale,
                               discrete_flow_shift=self.discrete_flow_shift)
        return sigmas.reshape(-1, 1, 1, 1).to(device, non_blocking=True)

    def per_element_loss(self, prediction: torch.Tensor, noisy_input: torch.Tensor, target: torch.Tensor,
                         sigmas: torch.Tensor, num_train_timesteps: int, weighted: bool = True) -> torch.Tensor:
        """The float32 loss of each element of the (B, C, h, w) prediction against the target, read and weighted
        as configured (``weighted=False``: no σ weighting, for a validation loss comparable across σ)."""
        if self.model_prediction_type is None:
            weighting = compute_loss_weighting_for_sd3(weighting_scheme=self.weighting_scheme, sigmas=sigmas).float()
        else:
            prediction, weighting = apply_model_prediction_type(self.model_prediction_type, prediction, noisy_input,
                                                                sigmas, self.weighting_scheme)
        # FLUX's timesteps are σ·T: where the exponential Huber schedule places each sample.
        per_element = self.loss.per_element(prediction, target, sigmas.flatten() * num_train_timesteps,
                                            num_train_timesteps)
        return per_element * weighting if weighted and weighting is not None else per_element
