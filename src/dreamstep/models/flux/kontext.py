"""FLUX.1 Kontext plumbing: the "before" image's latent tokens ride beside the target's, as diffusers'
``FluxKontextPipeline`` and ``train_dreambooth_lora_flux_kontext.py`` lay them out.

The transformer sees ``[target tokens | condition tokens]`` along the sequence; the condition tokens carry
the same (row, column) position ids as a target of their size, with the first rotary axis set to 1 instead
of 0, which is all that tells the two images apart. Only the target's tokens are a prediction: the rest of
the output is cut off before the loss (training) or the scheduler step (inference).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from dreamstep.models.flux import plumbing as flux

# The first rotary axis of an image token: 0 for the image being denoised, 1 for the condition image.
CONDITION_AXIS_VALUE = 1


@functools.lru_cache(maxsize=32)
def condition_image_ids(height: int, width: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Rotary position ids of a packed condition latent of ``height`` x ``width``: (h/2 · w/2, 3), the target's
    ids with the first axis set to :data:`CONDITION_AXIS_VALUE` (``FluxKontextPipeline.prepare_latents``)."""
    ids = FluxKontextPipeline._prepare_latent_image_ids(1, height // 2, width // 2, device, dtype)
    ids[..., 0] = CONDITION_AXIS_VALUE
    return ids


def joined_inputs(inputs: dict[str, Any], condition: torch.Tensor | None) -> dict[str, Any]:
    """The transformer's keyword arguments for a target (``hidden_states`` (B, N, 4C), ``img_ids`` (N, 3), ...) with
    a condition latent (B, C, h', w') beside it: ``hidden_states`` (B, N + N', 4C) and ``img_ids`` (N + N', 3).
    Without a condition (text-to-image Kontext training) the target's alone."""
    if condition is None:
        return inputs
    target, ids = inputs["hidden_states"], inputs["img_ids"]
    condition_ids = condition_image_ids(condition.shape[2], condition.shape[3], ids.device, ids.dtype)
    return {**inputs, "hidden_states": torch.cat([target, flux.pack(condition.to(target.dtype))], dim=1),
            "img_ids": torch.cat([ids, condition_ids], dim=0)}


def target_prediction(prediction: torch.Tensor, num_target_tokens: int) -> torch.Tensor:
    """The prediction of the target's tokens (B, N, 4C) out of the transformer's output (B, N + N', 4C)."""
    return prediction[:, :num_target_tokens]


# ---------------------------------------------------------------- pipeline

def edit_size(image_size: tuple[int, int], keep: bool) -> tuple[int, int]:
    """(width, height) at which ``FluxKontextPipeline`` edits an image of ``image_size``: the Kontext training
    resolution nearest its aspect ratio (what the pipeline resizes it to), or with ``keep`` its own size rounded
    down to the 16 pixels of a latent patch."""
    width, height = image_size
    if keep:
        return max(16, width // 16 * 16), max(16, height // 16 * 16)
    return min(PREFERRED_KONTEXT_RESOLUTIONS, key=lambda size: abs(width / height - size[0] / size[1]))
