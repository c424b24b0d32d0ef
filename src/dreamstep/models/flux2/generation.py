"""The FLUX.2 pipelines that generate: ``Flux2KleinPipeline`` ([klein]) and ``Flux2Pipeline`` ([dev]) from a diffusers
folder or a hub id in the local cache, with reference images for editing (``image``: one or several)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from PIL import Image

from dreamstep.errors import UserError
from dreamstep.models.flux2 import plumbing as flux2

# The pipeline class of each variant.
VARIANT_PIPELINES = {"flux2": "Flux2Pipeline", "flux2-klein": "Flux2KleinPipeline"}
# Sampling without flags: a distilled [klein] samples in 4 steps without guidance; the base [klein] models use
# classifier-free guidance, [dev] its distilled guidance, both over 50 steps (the pipelines' defaults).
DISTILLED_SAMPLING = {"steps": 4, "guidance_scale": 1.0}
BASE_SAMPLING = {"steps": 50, "guidance_scale": 4.0}


class _NegativePrompt:
    """``negative_prompt`` as dreamstep's generate passes it (``None`` when not given), which the FLUX.2 pipelines take
    as embeddings: encoded here by the pipeline's own ``encode_prompt``."""

    def __call__(self, *args: Any, negative_prompt: str | None = None, **kwargs: Any) -> Any:
        if negative_prompt:
            kwargs["negative_prompt_embeds"] = self.encode_prompt(
                negative_prompt, device=self._execution_device,
                max_sequence_length=kwargs.get("max_sequence_length", 512))[0]
        return super().__call__(*args, **kwargs)


class Flux2KleinGenerator(_NegativePrompt, Flux2KleinPipeline):
    """``Flux2KleinPipeline`` with a ``negative_prompt`` (the base models' classifier-free guidance)."""


class Flux2Generator(_NegativePrompt, Flux2Pipeline):
    """``Flux2Pipeline``, taking ``negative_prompt=None`` as generate passes it."""


GENERATORS = {"flux2": Flux2Generator, "flux2-klein": Flux2KleinGenerator}


def check_model(variant: str, model: str, model_config: str | None, component_files: Mapping[str, str]) -> None:
    """One line naming --model when it is not a FLUX.2 folder of ``variant`` (or a hub id in the local cache)."""
    if model_config is not None or component_files:
        raise UserError(f"--model_config / component files: {variant} loads from its diffusers folder; remove them")
    found = flux2.model_index(model, "--model")["_class_name"]
    if found != VARIANT_PIPELINES[variant]:
        other = next(v for v, cls in VARIANT_PIPELINES.items() if cls == found)
        raise UserError(f"--model {model}: a {found} folder; generate with it as 'dreamstep generate {other}'")


def pipeline(variant: str, model: str, dtype: torch.dtype) -> Any:
    generator = GENERATORS[variant].from_pretrained(model, dtype=dtype)
    generator.set_progress_bar_config(disable=True)  # generate shows its own progress
    return generator


def sampling_defaults(pipe: Any, images: Sequence[Image.Image]) -> dict[str, Any]:
    """Steps and guidance of the kind of model (distilled [klein] or not), and the size: the first reference
    image's (rounded down to the 16 px of a latent patch), else the native 1024²."""
    sampling = DISTILLED_SAMPLING if pipe.config.get("is_distilled", False) else BASE_SAMPLING
    if images:
        width, height = max(16, images[0].width // 16 * 16), max(16, images[0].height // 16 * 16)
    else:
        width = height = pipe.default_sample_size * pipe.vae_scale_factor
    return {**sampling, "width": width, "height": height}


def image_inputs(images: Sequence[Image.Image]) -> dict[str, Any]:
    """The reference images, in order (the pipelines give the i-th the time coordinate 10·(i + 1))."""
    return {"image": list(images)} if images else {}
