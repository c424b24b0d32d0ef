"""The Qwen-Image pipelines that generate: ``QwenImagePipeline``, and for edits ``QwenImageEditPlusPipeline`` (one to
three reference images; a Qwen-Image-Edit folder of the first release loads as ``QwenImageEditPipeline``), from a
diffusers folder or a hub id, the Edit pipelines with the torchvision-free processor
(:mod:`~dreamstep.models.qwen_image.vl_processor`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE, calculate_dimensions
from PIL import Image

from dreamstep.errors import UserError
from dreamstep.models.loading import _DTYPE_KWARG, _from_pretrained
from dreamstep.models.qwen_image import plumbing as qwen
from dreamstep.models.qwen_image.vl_processor import image_text_processor

EDIT_VARIANT = "qwen-image-edit"
# The pipelines' own defaults: 50 steps; true CFG 4 with a negative prompt (guidance_scale is for guidance-distilled
# models, which Qwen-Image is not).
SAMPLING = {"steps": 50, "guidance_scale": 1.0}


def check_model(variant: str, model: str, model_config: str | None, component_files: Mapping[str, str]) -> None:
    """One line naming --model (or --model_config) when the base is not a Qwen-Image folder or hub id."""
    if model_config is not None or component_files:
        raise UserError(f"--model_config: {variant} loads from a diffusers folder or hub id alone; remove it")
    qwen.check_base(model, "--model")
    found = qwen.pipeline_class_of(model)
    edits = found in (QwenImageEditPipeline.__name__, QwenImageEditPlusPipeline.__name__)
    if found is not None and edits != (variant == EDIT_VARIANT):
        raise UserError(f"--model {model}: holds a {found}; use generate "
                        f"{EDIT_VARIANT if edits else 'qwen-image'} for it")


def pipeline(variant: str, model: str, *, dtype: torch.dtype, controlnet: Any | None) -> Any:
    """The pipeline of ``variant`` on the CPU in ``dtype``."""
    if controlnet is not None:
        raise UserError("--controlnet: dreamstep has no Qwen-Image ControlNet; remove it")
    source = qwen.check_base(model, "--model")
    if variant != EDIT_VARIANT:
        return _from_pretrained(QwenImagePipeline, source, **{_DTYPE_KWARG: dtype})
    edit_class = (QwenImageEditPipeline if qwen.pipeline_class_of(source) == QwenImageEditPipeline.__name__
                  else QwenImageEditPlusPipeline)
    return _from_pretrained(edit_class, source, processor=image_text_processor(source), **{_DTYPE_KWARG: dtype})


def sampling_defaults(variant: str, pipe: Any, images: Sequence[Image.Image]) -> dict[str, Any]:
    """50 steps; the size: an edit's 1024² of area at its (last) image's aspect ratio, as the Edit pipelines
    choose it, else the model's native 1024²."""
    if images:
        width, height = calculate_dimensions(VAE_IMAGE_SIZE, images[-1].width / images[-1].height)
    else:
        width = height = pipe.default_sample_size * pipe.vae_scale_factor
    return {**SAMPLING, "width": width, "height": height}


def image_inputs(variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
    """The Edit pipelines take the reference images as ``image`` (a list for Edit-Plus)."""
    return {"image": list(images)} if images and variant == EDIT_VARIANT else {}
