"""``dreamstep generate VARIANT``: images from any family's model with any number of LoRAs and, for FLUX, a
ControlNet, through diffusers' pipelines; edit models (FLUX.1 Kontext) edit ``--image``.

Features: a diffusers folder, hub id or single-file ``--model`` (``--model_config`` supplies the rest of a
single file's pipeline); ``--prompt`` or ``--from_file`` (one prompt per line); ``--negative_prompt``
(FLUX: with ``--true_cfg_scale`` > 1); ``--lora FILE[:WEIGHT]``, repeatable, in every format ``dreamstep
convert`` reads, applied as adapters or folded into the weights (``--merge``); ``--controlnet`` with
``--control_image``; SDXL samples with Euler, 50 steps, CFG 7 by default (as sd-scripts' ``sdxl_minimal_inference.py``).

Each image is ``OUTPUT_DIR/<index>-<seed>.png`` (indices continue after the folder's earlier images), with
its parameters in PNG text chunks: ``parameters`` (A1111's layout) and ``dreamstep`` (JSON). Image ``i``
of a run uses seed ``--seed + i`` from its own CPU generator, so any one image is reproduced by running
again with its seed and ``--num_images 1``, on any device.
"""

from __future__ import annotations

import dataclasses
import secrets
import tempfile
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from tqdm.auto import tqdm

from dreamstep import __version__
from dreamstep.config.generate import GenerateConfig
from dreamstep.config.options import FluxComponentFileOptions
from dreamstep.data.images import load_rgb
from dreamstep.errors import UserError
from dreamstep.evaluation.candidates import controlnet_source, lora_file_for
from dreamstep.generation.loras import LoraSpec, apply_loras, check_lora, parse_lora_spec
from dreamstep.generation.outputs import next_index, save_png
from dreamstep.generation.pipelines import build_pipeline, check_model, choose_dtype
from dreamstep.models.family import variant_family
from dreamstep.models.precision import choose_device


def read_prompts(config: GenerateConfig) -> list[str]:
    if config.prompt is not None:
        return [config.prompt]
    path = Path(config.from_file).expanduser()
    if not path.is_file():
        raise UserError(f"--from_file {path}: file not found; check the path")
    try:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise UserError(f"--from_file {path}: not UTF-8 text; save it as UTF-8") from None
    if not prompts:
        raise UserError(f"--from_file {path}: no prompts in the file; write one prompt per line")
    return prompts


def _input_images(config: GenerateConfig) -> list[Image.Image]:
    """The images the pipeline call reads: an edit's input images, a ControlNet's control image."""
    flag, paths = config.input_images()
    images = []
    for value in paths:
        path = Path(value).expanduser()
        if not path.is_file():
            raise UserError(f"--{flag} {path}: file not found; check the path")
        images.append(load_rgb(path))
    return images


def _output_dir(config: GenerateConfig) -> Path:
    """The folder for the PNGs, checked now and created when the first image is written."""
    path = Path(config.output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"--output_dir {path} is a file; give a folder")
    return path


def resolve_settings(config: GenerateConfig, pipe: Any, images: list[Image.Image]) -> dict[str, Any]:
    """Steps, guidance and size: the flags, with the model's defaults for those not given."""
    defaults = variant_family(config.model_type).sampling_defaults(config.model_type, pipe, images)
    native = (config.sized_to_image(images[0].size) if images else None) or (defaults["width"], defaults["height"])
    width = config.width or (config.height if config.height else native[0])
    height = config.height or (config.width if config.width else native[1])
    return {"steps": config.steps or defaults["steps"], "width": width, "height": height,
            "guidance_scale": config.guidance_scale if config.guidance_scale is not None
            else defaults["guidance_scale"]}


def _pipeline_kwargs(config: GenerateConfig, settings: dict[str, Any], images: list[Image.Image]) -> dict[str, Any]:
    family = variant_family(config.model_type)
    return {"num_inference_steps": settings["steps"], "guidance_scale": settings["guidance_scale"],
            "width": settings["width"], "height": settings["height"], "negative_prompt": config.negative_prompt,
            **family.image_inputs(config.model_type, images, settings["width"], settings["height"]),
            **config.call_kwargs()}


def image_parameters(config: GenerateConfig, settings: dict[str, Any], loras: list[LoraSpec], dtype: torch.dtype,
                     prompt: str, seed: int) -> dict[str, Any]:
    """Everything needed to make the image again: stored in its PNG."""
    return {
        "model_type": config.model_type, "model": config.model, "model_config": config.model_config,
        "prompt": prompt, "negative_prompt": config.negative_prompt, "seed": seed, "sampler": "Euler",
        **settings, "loras": [{"path": str(s.path), "weight": s.weight} for s in loras], "merge": config.merge,
        "dtype": str(dtype).removeprefix("torch."), "dreamstep_version": __version__,
        **{flag: value for flag, value in config.own_parameters().items() if value is not None},
    }


def _batches(prompts: list[str], num_images: int, batch_size: int, first_seed: int) -> list[tuple[str, list[int]]]:
    """(prompt, seeds) per pipeline call; seeds run on across prompts so every image has its own."""
    calls, seed = [], first_seed
    for prompt in prompts:
        for start in range(0, num_images, batch_size):
            count = min(batch_size, num_images - start)
            calls.append((prompt, list(range(seed, seed + count))))
            seed += count
    return calls


def generate_images(config: GenerateConfig) -> list[Path]:
    """Generate every image ``config`` asks for; return the PNG paths. All input (prompts, LoRA files,
    control image, output folder) is checked before the model loads, and nothing is written before."""
    model_type = config.model_type
    prompts = read_prompts(config)
    parts = config.component_files() if isinstance(config, FluxComponentFileOptions) else None
    check_model(model_type, config.model, config.model_config, parts)
    loras = [parse_lora_spec(text) for text in config.lora]
    with tempfile.TemporaryDirectory(prefix="dreamstep-lora-") as work_dir:  # LoRAs of flux-lora checkpoints
        files = [dataclasses.replace(spec, path=lora_file_for(spec.path, Path(work_dir), "--lora",
                                                                  config.checkpoint_weights)) for spec in loras]
        for spec in files:
            check_lora(spec.path, config.lora_model)
        images = _input_images(config)
        controlnet = getattr(config, "controlnet", None)
        if controlnet is not None:  # a checkpoint-N of a ControlNet run, or a save_pretrained folder
            controlnet = controlnet_source(controlnet, Path(work_dir), config.checkpoint_weights)
        output_dir = _output_dir(config)
        device = choose_device(config.device)
        dtype = choose_dtype(config.dtype, device)
        pipe = build_pipeline(model_type, config.model, model_config=config.model_config, dtype=dtype,
                              component_files=parts, device=device, no_half_vae=config.no_half_vae,
                              controlnet=controlnet, cpu_offload=config.cpu_offload)
        apply_loras(pipe, files, config.lora_model, config.merge)
    settings = resolve_settings(config, pipe, images)
    kwargs = _pipeline_kwargs(config, settings, images)
    first_seed = config.seed if config.seed is not None else secrets.randbelow(2**31)
    calls = _batches(prompts, config.num_images, config.batch_size, first_seed)
    index = next_index(output_dir)
    written = []
    with tqdm(total=len(calls) * settings["steps"], unit="step", desc=f"generate {model_type}") as bar:
        def advance(*_: Any) -> dict:
            bar.update(1)
            return {}

        for prompt, seeds in calls:
            generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
            with torch.inference_mode():
                images = pipe(prompt=prompt, num_images_per_prompt=len(seeds), generator=generators,
                              callback_on_step_end=advance, **kwargs).images
            for image, seed in zip(images, seeds):
                params = image_parameters(config, settings, loras, dtype, prompt, seed)
                written.append(save_png(image, output_dir, index, params))
                index += 1
    return written
