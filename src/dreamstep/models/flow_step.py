"""The flow-matching training step of every family's recipe: it draws the target latents from their VAE posterior,
the condition latents (for a recipe that has some), the noise and σ, forms x_σ, asks the family's step for the
denoiser's prediction, and scores it against the velocity target with the objective's weighting, instance and prior
samples apart. A family's step writes only :meth:`FlowMatchingStep.velocity` (its denoiser's inputs and output
layout); a recipe may add :meth:`~FlowMatchingStep.condition` when it has a condition image.

The draws happen in the order of diffusers' training scripts (target latents, condition latents, noise, σ), so one
step can be checked against them with the same generator.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from dreamstep.diffusion import flow_matching as fm
from dreamstep.diffusion.losses import masked
from dreamstep.engine.train_step import TrainStep
from dreamstep.models.precision import in_compute_dtype
from dreamstep.models.vae import posterior_mean, sample_latents


class FlowMatchingStep(TrainStep):
    """One flow-matching step (see the module docstring). ``model`` is what trains (and what DDP wraps); ``sigmas``
    the training σ table; ``objective`` how σ is drawn and the prediction scored; ``prior_loss_weight`` weights the
    regularization samples' mean loss against the instance samples' (``None``: one mean over the batch), or with
    ``per_sample_prior_weight`` each regularization sample's loss before the batch mean (sd-scripts'
    ``loss_weights``)."""

    def __init__(self, model: torch.nn.Module, *, sigmas: torch.Tensor, objective: fm.FlowMatchingObjective,
                 prior_loss_weight: float | None = None, per_sample_prior_weight: bool = False,
                 **engine_options: Any):
        super().__init__(model, **engine_options)
        self.sigmas = sigmas  # (num_train_timesteps,): the training σ table
        self.objective = objective
        self.prior_loss_weight = prior_loss_weight
        self.per_sample_prior_weight = per_sample_prior_weight

    @abc.abstractmethod
    def velocity(self, model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any],
                 condition: torch.Tensor | None) -> torch.Tensor:
        """The denoiser's prediction for x_σ ``noisy`` (B, C, h, w) at σ ``sigmas`` (B, 1, 1, 1), in the latents'
        shape (B, C, h, w): the family lays the inputs out as its denoiser reads them (packing, position ids,
        text embeddings from ``batch``) and the output back. ``condition`` is what :meth:`condition` gave."""

    def target(self, batch: dict[str, Any]) -> torch.Tensor:
        """The target latents (B, C, h, w): one draw from their posterior (a recipe may take its mode instead)."""
        return sample_latents(batch["latent_dist"])

    def condition(self, batch: dict[str, Any], sample: bool) -> torch.Tensor | None:
        """The condition latents (B, C, h, w) of a recipe with a condition image, drawn from their posterior
        (``sample``) or its mean (validation); ``None`` without one."""
        return None

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        # latent_dist: (B, 2C, h, w), the VAE posterior's mean and std, already shifted and scaled.
        latents = self.target(batch)
        condition = self.condition(batch, sample=True)
        noise = torch.randn_like(latents)
        sigmas = self.objective.sample(self.sigmas, len(latents), latents.shape[2:], latents.device)
        per_sample = self.per_sample_loss(self.model, batch, latents, noise, sigmas, True, condition)
        if self.prior_loss_weight is None:
            return per_sample.mean()
        if self.per_sample_prior_weight:
            weights = torch.where(batch["is_reg"], self.prior_loss_weight, 1.0).to(per_sample.device, non_blocking=True)
            return (per_sample * weights).mean()
        return fm.instance_plus_prior_loss(per_sample, batch["is_reg"], self.prior_loss_weight)

    def validation_loss_at(self, batch: dict[str, Any], latents: torch.Tensor, noise: torch.Tensor,
                           fraction: float) -> torch.Tensor:
        """Unweighted loss of each sample, (B,), at the fixed σ that ``fraction`` of the schedule selects, with
        the condition posterior's mean (validation)."""
        sigmas = torch.full((len(latents), 1, 1, 1), fm.sigma_at_fraction(self.sigmas, fraction),
                            device=latents.device)
        condition = self.condition(batch, sample=False)
        with self.autocast():
            return self.per_sample_loss(self.unwrapped_model, batch, latents, noise, sigmas, False, condition)

    def per_sample_loss(self, model: torch.nn.Module, batch: dict[str, Any], latents: torch.Tensor,
                        noise: torch.Tensor, sigmas: torch.Tensor, weighted: bool,
                        condition: torch.Tensor | None) -> torch.Tensor:
        """The flow-matching loss of each sample, (B,), for given latents, noise and σ (B, 1, 1, 1); ``weighted``:
        with the objective's σ weighting (training) or without (validation)."""
        # x_σ = (1 - σ)·x + σ·ε
        noisy = fm.noisy_latents(latents, noise, sigmas)
        # The denoiser reads x_σ, the condition and the text embeddings in the compute dtype (bf16 under
        # --mixed_precision bf16), as diffusers' scripts cast them; the loss stays fp32 (``model_pred.float()``).
        device_type = latents.device.type
        pred = self.velocity(model, in_compute_dtype(noisy, device_type), sigmas,
                             in_compute_dtype(batch, device_type), in_compute_dtype(condition, device_type)).float()
        # Flow-matching target v = ε - x; the loss of each element (--loss_type), weighted by its sample's own σ.
        per_element = self.objective.per_element_loss(pred, noisy, fm.velocity_target(latents, noise), sigmas,
                                                      len(self.sigmas), weighted)
        if "masks" in batch:  # --masked_loss: a black region of the image contributes nothing
            per_element = masked(per_element, batch["masks"])
        return per_element.reshape(len(latents), -1).mean(dim=1)


def condition_latents(batch: dict[str, Any], sample: bool, key: str = "condition_dist") -> torch.Tensor:
    """A condition image's latents from its posterior in ``batch[key]``: one draw, or the mean."""
    return sample_latents(batch[key]) if sample else posterior_mean(batch[key])
