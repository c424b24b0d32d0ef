"""The SDXL pipeline that generates, with sd-scripts' sampler (``sdxl_minimal_inference.py``: Euler, 50 steps,
CFG 7), from a diffusers folder, a hub id or a single checkpoint file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
from PIL import Image

from dreamstep.errors import UserError
from dreamstep.models.loading import load_sdxl
from dreamstep.models.sdxl.plumbing import config_source
from dreamstep.models.sources import SDXL_BASE, check_model_config, check_pipeline_source, is_single_file

SAMPLING = {"steps": 50, "guidance_scale": 7.0}


def check_model(model: str, model_config: str | None, component_files: Mapping[str, str]) -> None:
    if component_files:
        raise UserError(f"--{next(iter(component_files))} is a FLUX component file; SDXL takes none")
    check_model_config(model, model_config, is_single_file(model))
    check_pipeline_source(model, "sdxl", "--model", configs_given=model_config is not None)
    if model_config is not None and is_single_file(model):
        check_pipeline_source(model_config, "sdxl", "--model_config")


def pipeline(model: str, *, model_config: str | None, dtype: torch.dtype) -> StableDiffusionXLPipeline:
    config = None
    if is_single_file(model):
        # --model_config, or the file's own folder when that holds model_index.json (as the trainer reads it).
        beside = (Path(model).expanduser().parent / "model_index.json").is_file()
        config = config_source(model, model_config) if model_config or beside else SDXL_BASE
    pipe = StableDiffusionXLPipeline(**vars(load_sdxl(model, config=config, weight_dtype=dtype)),
                                     add_watermarker=False)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    return pipe


def sampling_defaults(pipe: Any, images: Sequence[Image.Image]) -> dict[str, Any]:
    size = pipe.default_sample_size * pipe.vae_scale_factor
    return {**SAMPLING, "width": size, "height": size}
