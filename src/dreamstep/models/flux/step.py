"""The FLUX flow-matching training step every FLUX recipe extends: it draws the target latents from their VAE
posterior, the condition latents (for a recipe that has some), the noise and the timesteps, builds the
transformer's inputs (packed x_σ, σ, guidance, prompt embeddings, position ids), and scores the prediction
against the velocity target with the SD3 weighting, instance and prior samples apart. A recipe's step writes
only :meth:`FluxFlowMatchingStep.predict`, and :meth:`~FluxFlowMatchingStep.condition` when it has a
condition image.

The draws happen in the order of diffusers' FLUX training scripts (target latents, condition latents, noise,
timesteps), so one step can be checked against them with the same generator.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from dreamstep.diffusion import flow_matching as fm
from dreamstep.diffusion.losses import masked
from dreamstep.engine.train_step import TrainStep
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.vae import posterior_mean, sample_latents


class FluxFlowMatchingStep(TrainStep):
    """One flow-matching step of a FLUX transformer (see the module docstring). ``model`` is what trains (and
    what DDP wraps); ``sigmas`` the training σ table; ``objective`` how σ is drawn and the prediction scored
    (``FluxTrainingConfig.flow_matching_objective()``); ``guidance_scale`` is fed to guidance-distilled bases
    (``None`` for the others); ``prior_loss_weight`` weights the regularization samples' mean loss against the
    instance samples' (``None``: one mean over the batch), or with ``per_sample_prior_weight`` each regularization
    sample's loss before the batch mean (sd-scripts' ``loss_weights``)."""

    def __init__(self, model: torch.nn.Module, *, sigmas: torch.Tensor, objective: fm.FlowMatchingObjective,
                 guidance_scale: float | None, prior_loss_weight: float | None = None,
                 per_sample_prior_weight: bool = False, **engine_options: Any):
        super().__init__(model, **engine_options)
        self.sigmas = sigmas  # (num_train_timesteps,): the training σ table
        self.objective = objective
        self.guidance_scale = guidance_scale
        self.prior_loss_weight = prior_loss_weight
        self.per_sample_prior_weight = per_sample_prior_weight

    @abc.abstractmethod
    def predict(self, model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, Any],
                condition: torch.Tensor | None) -> torch.Tensor:
        """The velocity predicted for the target's packed tokens, (B, N, 4C). ``inputs`` are the transformer's
        keyword arguments for the target (``hidden_states`` (B, N, 4C), ``timestep``, ``guidance``,
        ``pooled_projections``, ``encoder_hidden_states``, ``txt_ids``, ``img_ids`` (N, 3)); ``condition`` is
        what :meth:`condition` gave."""

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
        bsz, _, height, width = latents.shape
        # x_σ = (1 - σ)·x + σ·ε; the model sees it packed into 2x2 patches: (B, h/2 · w/2, 4C).
        noisy = fm.noisy_latents(latents, noise, sigmas)
        packed = flux.pack(noisy)
        guidance = (torch.full((bsz,), self.guidance_scale, device=latents.device)
                    if self.guidance_scale is not None else None)
        inputs = dict(hidden_states=packed, timestep=sigmas.flatten(), guidance=guidance,
                      pooled_projections=batch["pooled"], encoder_hidden_states=batch["prompt_embeds"],
                      txt_ids=batch["text_ids"], img_ids=flux.latent_image_ids(height, width, latents.device,
                                                                              packed.dtype))
        pred = flux.unpack(self.predict(model, inputs, batch, condition), height, width)
        # Flow-matching target v = ε - x; the loss of each element (--loss_type), weighted by its sample's own σ.
        per_element = self.objective.per_element_loss(pred, noisy, fm.velocity_target(latents, noise), sigmas,
                                                      len(self.sigmas), weighted)
        if "masks" in batch:  # --masked_loss: a black region of the image contributes nothing
            per_element = masked(per_element, batch["masks"])
        return per_element.reshape(bsz, -1).mean(dim=1)


def condition_latents(batch: dict[str, Any], sample: bool, key: str = "condition_dist") -> torch.Tensor:
    """A condition image's latents from its posterior in ``batch[key]``: one draw, or the mean."""
    return sample_latents(batch[key]) if sample else posterior_mean(batch[key])
