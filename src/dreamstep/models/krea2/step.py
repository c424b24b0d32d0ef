"""The Krea 2 flow-matching step: :class:`~dreamstep.models.flow_step.FlowMatchingStep` with the transformer's
inputs as diffusers' ``train_dreambooth_lora_krea2.py`` feeds them: x_σ packed into 2x2 patches, the timestep σ
(``t / 1000``), the stacked features of the text encoder's selected layers (B, S, L, D) with their mask, and rotary
coordinates of the [text, image] sequence. Latents are one draw from the posterior, as the script's."""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers import Krea2Pipeline

from dreamstep.models.flow_step import FlowMatchingStep


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 · w/2, 4C)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, h/2 · w/2, 4C) -> (B, C, h, w) for a latent of ``height`` x ``width``."""
    b, _, channels = tokens.shape
    return (tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
            .reshape(b, channels // 4, height, width))


@functools.lru_cache(maxsize=32)
def position_ids(text_tokens: int, height: int, width: int, device: torch.device) -> torch.Tensor:
    """Rotary coordinates (S + h/2 · w/2, 3) of the joint sequence, made once per size and device (the model only
    reads them)."""
    return Krea2Pipeline.prepare_position_ids(text_tokens, height // 2, width // 2, device)


def krea2_velocity(model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                   prompt_mask: torch.Tensor) -> torch.Tensor:
    """The velocity predicted for x_σ ``noisy`` (B, C, h, w) at σ ``sigmas`` (B, 1, 1, 1), in the latents' shape."""
    _, _, height, width = noisy.shape
    ids = position_ids(prompt_embeds.shape[1], height, width, noisy.device)
    prediction = model(hidden_states=pack(noisy), encoder_hidden_states=prompt_embeds, timestep=sigmas.flatten(),
                       position_ids=ids, encoder_attention_mask=prompt_mask, return_dict=False)[0]
    return unpack(prediction, height, width)


class Krea2FlowMatchingStep(FlowMatchingStep):
    """A flow-matching step of a Krea 2 transformer; the arguments are
    :class:`~dreamstep.models.flow_step.FlowMatchingStep`'s."""

    def velocity(self, model: torch.nn.Module, noisy: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, Any],
                 condition: torch.Tensor | None) -> torch.Tensor:
        return krea2_velocity(model, noisy, sigmas, batch["prompt_embeds"], batch["prompt_mask"])
