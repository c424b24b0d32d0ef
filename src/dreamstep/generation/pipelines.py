"""Building the diffusers pipeline that generates: FLUX.1 (``FluxPipeline``, or ``FluxControlNetPipeline``
with a ControlNet), FLUX.1 Kontext (``FluxKontextPipeline``) or SDXL (``StableDiffusionXLPipeline`` with sd-scripts'
Euler sampler), from a diffusers folder, a hub id or a single file, on the chosen device and precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import (
    EulerDiscreteScheduler,
    FluxControlNetModel,
    FluxControlNetPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    StableDiffusionXLPipeline,
)
from safetensors.torch import load_file

from dreamstep.config.schema import load_toml
from dreamstep.errors import UserError, refusing_pickled_code
from dreamstep.evaluation.candidates import Candidate
from dreamstep.models.flux import controlnet as cn
from dreamstep.models.flux.files import FILE_SUFFIXES, resolve_base
from dreamstep.models.loading import CHECKPOINT_SUFFIXES, check_pipeline_source, load_flux, load_sdxl
from dreamstep.models.precision import dtype_named
from dreamstep.models.sdxl.plumbing import config_source

# Where a single-file --model takes its other components and configs when --model_config is not given.
DEFAULT_BASES = {"flux": "black-forest-labs/FLUX.1-dev", "flux-kontext": "black-forest-labs/FLUX.1-Kontext-dev",
                 "sdxl": "stabilityai/stable-diffusion-xl-base-1.0"}


def choose_dtype(precision: str, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on the CPU (half precision is slow there), bf16 on GPUs that have it, else fp16."""
    if precision != "auto":
        return dtype_named(precision, "--dtype")
    if device.type == "cpu":
        return torch.float32
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


def is_single_file(model: str) -> bool:
    return Path(model).expanduser().is_file() or model.endswith((*CHECKPOINT_SUFFIXES, *FILE_SUFFIXES))


def _flux_pipeline(model_type: str, model: str, model_config: str | None, dtype: torch.dtype,
                   controlnet: str | Candidate | None,
                   component_files: dict[str, str]) -> FluxPipeline | FluxKontextPipeline:
    beside = (Path(model).expanduser().parent / "model_index.json").is_file()
    if is_single_file(model) and model_config is None and not beside and len(component_files) < 3:
        model_config = DEFAULT_BASES[model_type]  # the parts no file gives, from the hub (or its cache)
    base = resolve_base(model, model_config=model_config, **component_files)
    components = load_flux(base.source, files=base.files, weight_dtype=dtype)
    parts = vars(components)
    if model_type == "flux-kontext":
        return FluxKontextPipeline(**parts)
    if controlnet is None:
        return FluxPipeline(**parts)
    if isinstance(controlnet, Candidate):
        return FluxControlNetPipeline(**parts, controlnet=controlnet_from_checkpoint(controlnet, parts["transformer"],
                                                                                     dtype))
    return FluxControlNetPipeline(**parts, controlnet=load_flux_controlnet(controlnet, dtype))


def load_flux_controlnet(folder: str, dtype: torch.dtype) -> FluxControlNetModel:
    """A FLUX ControlNet in the ``save_pretrained`` layout (what ``train flux-controlnet`` writes)."""
    path = Path(folder).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"--controlnet {folder}: no config.json there; give the folder that "
                        "train flux-controlnet (or save_pretrained) wrote")
    try:
        with refusing_pickled_code(path, "--controlnet"):
            return FluxControlNetModel.from_pretrained(str(path)).to(dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"--controlnet {folder}: could not load the ControlNet ({e})") from e


def controlnet_from_checkpoint(checkpoint: Candidate, transformer: torch.nn.Module,
                               dtype: torch.dtype) -> FluxControlNetModel:
    """The ControlNet of a flux-controlnet run's ``checkpoint-N``: built from the base transformer as the run built
    it (its config.toml's block counts), with the checkpoint's weights."""
    run = load_toml(checkpoint.config_dir / "config.toml")
    model = cn.build_from_transformer(transformer, run.get("num_double_layers", 4), run.get("num_single_layers", 4))
    model.load_state_dict(load_file(str(checkpoint.path)))
    return model.to(dtype)


def _sdxl_pipeline(model: str, model_config: str | None, dtype: torch.dtype) -> StableDiffusionXLPipeline:
    # A single file's configs: --model_config, or its own folder when that holds model_index.json (as the trainer
    # reads it), else SDXL base 1.0's from the hub (or its cache).
    config = None
    if is_single_file(model):
        beside = (Path(model).expanduser().parent / "model_index.json").is_file()
        config = config_source(model, model_config) if model_config or beside else DEFAULT_BASES["sdxl"]
    components = load_sdxl(model, config=config, weight_dtype=dtype)
    pipe = StableDiffusionXLPipeline(**vars(components), add_watermarker=False)
    # sd-scripts' sdxl_minimal_inference.py samples with Euler.
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    return pipe


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


def check_model(model_type: str, model: str, model_config: str | None) -> None:
    """One line naming --model or --model_config when the base model is not there, before anything loads (FLUX
    component files are checked where they are read)."""
    arch = "sdxl" if model_type == "sdxl" else "flux"
    if arch == "sdxl" or not is_single_file(model):
        check_pipeline_source(model, arch, "--model")
    if model_config is not None and is_single_file(model):  # else build_pipeline refuses it
        check_pipeline_source(model_config, arch, "--model_config")


def build_pipeline(model_type: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                   device: torch.device, no_half_vae: bool = False, controlnet: str | Candidate | None = None,
                   cpu_offload: bool = False, component_files: dict[str, str] | None = None) -> Any:
    """The pipeline for ``model_type`` ('flux', 'flux-kontext' or 'sdxl') on ``device`` in ``dtype``;
    ``no_half_vae`` keeps the VAE in fp32 (SDXL's VAE overflows in fp16); ``cpu_offload`` moves each model to the
    GPU only while it runs; ``component_files``: FLUX's ``clip_l``, ``t5xxl``, ``ae`` files by flag name."""
    if model_config is not None and not is_single_file(model):
        raise UserError("--model_config only applies to a single-file --model; remove it (a folder or hub id "
                        "has its own configs)")
    if model_type.startswith("flux"):
        pipe = _flux_pipeline(model_type, model, model_config, dtype, controlnet, component_files or {})
    elif component_files:
        raise UserError(f"--{next(iter(component_files))} is a FLUX component file; SDXL takes none")
    else:
        pipe = _sdxl_pipeline(model, model_config, dtype)
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


def default_size(pipe: Any) -> int:
    """The model's native resolution, as diffusers computes it when no size is given."""
    return pipe.default_sample_size * pipe.vae_scale_factor
