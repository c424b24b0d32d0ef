"""The FLUX.2 flow-matching step: :class:`~dreamstep.models.flow_step.FlowMatchingStep` with the transformer's inputs
as diffusers' FLUX.2 scripts build them (x_σ of the patchified, normalised latents packed one token per position,
(T, H, W, L) position ids, σ as the timestep, guidance for a guidance-distilled base) and, for reference editing,
the condition image's tokens after the target's with their own time coordinate; the prediction is cut back to the
target's tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from dreamstep.models.flow_step import FlowMatchingStep, condition_latents
from dreamstep.models.flux2 import plumbing as flux2
from dreamstep.models.vae import posterior_mean

# The time coordinate of the first reference image's tokens (``Flux2Pipeline._prepare_image_ids``' scale).
REFERENCE_TIME = 10


class Flux2Step(FlowMatchingStep):
    """One FLUX.2 LoRA step. The latents are their posterior's mode, as the scripts encode them
    (``latent_dist.mode()``); ``guidance_scale`` is fed to a guidance-distilled base ([dev]) and ``None`` for the
    others; the other arguments are :class:`~dreamstep.models.flow_step.FlowMatchingStep`'s."""

    def __init__(self, model: torch.nn.Module, *, guidance_scale: float | None, **step_options: Any):
        super().__init__(model, **step_options)
        self.guidance_scale = guidance_scale

    def target(self, batch: dict[str, Any]) -> torch.Tensor:
        return posterior_mean(batch["latent_dist"])

    def condition(self, batch: dict[str, Any], sample: bool) -> torch.Tensor | None:
        return condition_latents(batch, sample=False) if "condition_dist" in batch else None

    def velocity(self, model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any],
                 condition: torch.Tensor | None) -> torch.Tensor:
        bsz, _, height, width = noisy.shape
        tokens, ids = flux2.pack(noisy), flux2.latent_ids(height, width, noisy.device)
        if condition is not None:
            tokens = torch.cat([tokens, flux2.pack(condition.to(tokens.dtype))], dim=1)
            ids = torch.cat([ids, flux2.latent_ids(condition.shape[2], condition.shape[3], noisy.device,
                                                   REFERENCE_TIME)])
        embeds = batch["prompt_embeds"]
        guidance = (torch.full((bsz,), self.guidance_scale, device=noisy.device)
                    if self.guidance_scale is not None else None)
        prediction = model(hidden_states=tokens, encoder_hidden_states=embeds, timestep=sigmas.flatten(),
                           img_ids=ids, txt_ids=flux2.text_ids(embeds.shape[1], noisy.device), guidance=guidance,
                           return_dict=False)[0]
        return flux2.unpack(prediction[:, :height * width], height, width)
