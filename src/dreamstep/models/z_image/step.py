"""The Z-Image flow-matching step: :class:`~dreamstep.models.flow_step.FlowMatchingStep` with the transformer's
inputs as diffusers' ``train_dreambooth_lora_z_image.py`` feeds them.

Z-Image's conventions, all the script's: latents are the VAE posterior's mode; the transformer takes a list of
per-sample latents (C, 1, h, w) (a frame axis of one), a timestep that runs the other way (``(1000 - t) / 1000``,
which is 1 - σ: 1 is the clean image) and a list of per-sample caption features (S_i, D) of each caption's own
length; it predicts x - ε, so the velocity is its negation.
"""

from __future__ import annotations

from typing import Any

import torch

from dreamstep.models.flow_step import FlowMatchingStep
from dreamstep.models.vae import posterior_mean


def caption_features(batch: dict[str, Any]) -> list[torch.Tensor]:
    """Each sample's caption features (S_i, D), cut from the batch's padded ``prompt_embeds`` (B, S, D) at its
    ``prompt_lengths`` (B,) (held on the CPU, so cutting never waits for the device)."""
    return [embeds[:length] for embeds, length in zip(batch["prompt_embeds"], batch["prompt_lengths"].tolist())]


def z_image_velocity(model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor,
                     captions: list[torch.Tensor]) -> torch.Tensor:
    """The velocity ε - x predicted for x_σ ``noisy`` (B, C, h, w) at σ ``sigmas`` (B, 1, 1, 1), in the latents'
    shape."""
    latents = list(noisy.unsqueeze(2).unbind(0))  # B x (C, 1, h, w)
    prediction = model(latents, 1.0 - sigmas.flatten(), captions, return_dict=False)[0]
    return -torch.stack(prediction).squeeze(2)


class ZImageFlowMatchingStep(FlowMatchingStep):
    """A flow-matching step of a Z-Image transformer (``model``: it, or what wraps it for DDP); the arguments are
    :class:`~dreamstep.models.flow_step.FlowMatchingStep`'s."""

    def target(self, batch: dict[str, Any]) -> torch.Tensor:
        return posterior_mean(batch["latent_dist"])

    def velocity(self, model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any],
                 condition: torch.Tensor | None) -> torch.Tensor:
        return z_image_velocity(model, noisy, sigmas, caption_features(batch))
