"""The diffusers pipeline that generates, on the chosen device and precision: each family builds its own
(:meth:`~dreamstep.models.family.ModelFamily.generation_pipeline`, from a diffusers folder, a hub id or a single
file); here it is placed on the device or offloaded, with the VAE kept in fp32 when asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dreamstep.errors import UserError
from dreamstep.models.family import ModelFamily, all_variants, variant_family
from dreamstep.models.precision import dtype_named


def choose_dtype(precision: str, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on the CPU (half precision is slow there), bf16 on GPUs that have it, else fp16."""
    if precision != "auto":
        return dtype_named(precision, "--dtype")
    if device.type == "cpu":
        return torch.float32
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


def _cast_inputs(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point tensors ``module`` is called with to ``dtype``."""

    def cast(value: Any) -> Any:
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    def hook(_: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def keep_vae_fp32(pipe: Any) -> None:
    """``--no_half_vae``: the VAE in fp32 (SDXL's overflows in fp16). The pipelines hand the VAE latents
    in the denoiser's dtype, and the FLUX ControlNet gets the VAE's encoding of the control image, so
    both see their inputs cast to their own dtype."""
    half = pipe.vae.dtype
    vae = pipe.vae.to(torch.float32)
    _cast_inputs(vae.post_quant_conv if getattr(vae, "post_quant_conv", None) is not None else vae.decoder,
                 torch.float32)
    if getattr(pipe, "controlnet", None) is not None:
        _cast_inputs(pipe.controlnet, half)


def check_model(model_type: str, model: str, model_config: str | None,
                component_files: Mapping[str, str] | None = None) -> None:
    """One line naming --model, --model_config or a component file when the base model is not there, before anything
    loads."""
    _family(model_type).check_generation_model(model_type, model, model_config, component_files or {})


def build_pipeline(model_type: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                   device: torch.device, no_half_vae: bool = False, controlnet: Any | None = None,
                   cpu_offload: bool = False, component_files: Mapping[str, str] | None = None) -> Any:
    """The pipeline of the variant ``model_type`` (``flux``, ``flux-kontext``, ``sdxl``, ...) on ``device`` in
    ``dtype``; ``no_half_vae`` keeps the VAE in fp32 (SDXL's VAE overflows in fp16); ``cpu_offload`` moves each model
    to the GPU only while it runs; ``component_files``: a single file's other components by flag name (FLUX's
    ``clip_l``, ``t5xxl``, ``ae``); ``controlnet``: a ControlNet folder or checkpoint, where the family has them."""
    check_model(model_type, model, model_config, component_files)
    pipe = _family(model_type).generation_pipeline(model_type, model, model_config=model_config, dtype=dtype,
                                                   component_files=component_files or {}, controlnet=controlnet)
    if no_half_vae and dtype != torch.float32:
        keep_vae_fp32(pipe)
    if cpu_offload:
        if device.type == "cpu":
            raise UserError("--cpu_offload needs a GPU (--device cuda); on the CPU everything is already there")
        pipe.enable_model_cpu_offload(device=device)
    else:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _family(model_type: str) -> ModelFamily:
    family = variant_family(model_type)
    if family is None:
        raise UserError(f"{model_type}: no model family has this variant; use one of {', '.join(all_variants())}")
    return family


def default_size(pipe: Any) -> int:
    """The model's native resolution, as diffusers computes it when no size is given."""
    return pipe.default_sample_size * pipe.vae_scale_factor
