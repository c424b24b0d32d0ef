"""The Z-Image pipeline that generates (``generate z-image``, ``eval z-image``): ``ZImagePipeline`` from a diffusers
folder or hub id, sampled as its model card says (Turbo: 9 steps, no guidance; the base: 50 steps at 4)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import ZImagePipeline
from PIL import Image

from dreamstep.models.loading import _DTYPE_KWARG, _from_pretrained
from dreamstep.models.z_image import configs
from dreamstep.models.z_image.plumbing import check_source

NATIVE_SIZE = 1024


def check_model(model: str) -> None:
    check_source(model, "--model")


def pipeline(model: str, dtype: torch.dtype) -> ZImagePipeline:
    return _from_pretrained(ZImagePipeline, model, **{_DTYPE_KWARG: dtype})


def sampling_defaults(pipe: Any, images: Sequence[Image.Image]) -> dict[str, Any]:
    """Turbo's or the base's recommended steps and guidance (told apart by the model's name), at 1024²."""
    sampling = (configs.TURBO_SAMPLING if configs.is_distilled(pipe.config.get("_name_or_path"))
                else configs.BASE_SAMPLING)
    return {"steps": sampling["steps"], "guidance_scale": sampling["guidance_scale"], "width": NATIVE_SIZE,
            "height": NATIVE_SIZE}
