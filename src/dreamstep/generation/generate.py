"""``dreamstep generate flux|sdxl``: images from FLUX.1 or SDXL with any number of LoRAs and, for FLUX, a
ControlNet, through diffusers' pipelines.

Features: a diffusers folder, hub id or single-file ``--model`` (``--model_config`` supplies the rest of a
single file's pipeline); ``--prompt`` or ``--from_file`` (one prompt per line); ``--negative_prompt``
(FLUX: with ``--true_cfg_scale`` > 1); ``--lora FILE[:WEIGHT]``, repeatable, in every format ``dreamstep
convert`` reads, applied as adapters or folded into the weights (``--merge``); ``--controlnet`` with
``--control_image``; SDXL samples with Euler, 50 steps, CFG 7 by default (the seed's minimal inference).

Each image is ``OUTPUT_DIR/<index>-<seed>.png`` (indices continue after the folder's earlier images), with
its parameters in PNG text chunks: ``parameters`` (A1111's layout) and ``dreamstep`` (JSON). Image ``i``
of a run uses seed ``--seed + i`` from its own CPU generator, so any one image is reproduced by running
again with its seed and ``--num_images 1``, on any device.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from PIL import Image
from tqdm.auto import tqdm

from dreamstep import __version__
from dreamstep.config.schema import option
from dreamstep.data.images import load_rgb
from dreamstep.errors import UserError
from dreamstep.generation.loras import LoraSpec, apply_loras, parse_lora_spec
from dreamstep.generation.outputs import next_index, save_png
from dreamstep.generation.pipelines import (
    build_pipeline,
    choose_device,
    choose_dtype,
    default_size,
)

# Both models' VAEs downsample 8x; FLUX packs 2x2 latent patches on top.
SIZE_MULTIPLE = {"flux": 16, "sdxl": 8}
SDXL_DEFAULTS = {"steps": 50, "guidance_scale": 7.0}


@dataclass
class GenerateConfig:
    model: str = option(help="diffusers pipeline folder, hub id, or single file (SDXL checkpoint such as "
                             "sd_xl_base_1.0.safetensors; FLUX transformer such as flux1-dev.safetensors)")
    model_config: str | None = option(None, "for a single-file --model: the diffusers folder or hub id "
                                            "that supplies the other components and configs (default: "
                                            "FLUX.1-dev / SDXL base 1.0 from the hub)")
    prompt: str | None = option(None, "the prompt")
    from_file: str | None = option(None, "text file with one prompt per line (blank lines skipped), "
                                         "instead of --prompt")
    negative_prompt: str | None = option(None, "what to steer away from (FLUX: needs --true_cfg_scale > 1)")
    lora: list[str] = option([], "LoRA file, optionally FILE:WEIGHT (default weight 1); repeat the flag "
                                 "or list several; Kohya, diffusers/PEFT and MindSpore .ckpt files load")
    merge: bool = option(False, "fold the LoRAs into the model weights (faster sampling) instead of "
                                "applying them as adapters")
    controlnet: str | None = option(None, "FLUX ControlNet folder (config.json + weights)")
    control_image: str | None = option(None, "the ControlNet's conditioning image")
    controlnet_conditioning_scale: float = option(1.0, "strength of the ControlNet's residuals")
    steps: int | None = option(None, "sampling steps (default: SDXL 50; FLUX 28, or 4 for a model "
                                     "without guidance embedding such as FLUX.1-schnell)")
    guidance_scale: float | None = option(None, "SDXL: classifier-free guidance (default 7); FLUX: the "
                                                "distilled guidance value (default 3.5; schnell ignores it)")
    true_cfg_scale: float = option(1.0, "FLUX: classifier-free guidance with --negative_prompt when > 1 "
                                        "(two transformer passes per step)")
    width: int | None = option(None, "image width (default: --height if given, else the model's native size "
                                     "or the control image's)")
    height: int | None = option(None, "image height (default: --width if given, else as for --width)")
    num_images: int = option(1, "images per prompt")
    batch_size: int = option(1, "images per pipeline call")
    seed: int | None = option(None, "seed of the first image; image i uses seed + i (default: random)")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = option("auto", "weight and compute precision; auto: fp32 "
                                                            "on the CPU, bf16 (else fp16) on a GPU")
    device: str | None = option(None, "cpu, cuda, cuda:N or mps (default: the best available)")
    no_half_vae: bool = option(False, "keep the VAE in fp32 when --dtype is half precision")
    cpu_offload: bool = option(False, "keep each model on the CPU until it runs (large models, small GPUs)")
    output_dir: str = option("outputs", "folder for the PNGs; earlier images there are kept")

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.from_file is None):
            raise UserError("give --prompt or --from_file (one of them)")
        for flag in ("num_images", "batch_size", "steps", "width", "height"):
            value = getattr(self, flag)
            if value is not None and value < 1:
                raise UserError(f"--{flag} must be at least 1 (got {value})")
        if self.controlnet is not None and self.control_image is None:
            raise UserError("--controlnet needs --control_image (the conditioning image)")
        if self.control_image is not None and self.controlnet is None:
            raise UserError("--control_image needs --controlnet (the ControlNet folder)")


def check_for_model(config: GenerateConfig, model_type: str) -> None:
    """The checks that depend on the model family."""
    if model_type == "sdxl" and config.controlnet is not None:
        raise UserError("--controlnet is supported for FLUX.1 only; use 'dreamstep generate flux'")
    if model_type == "flux" and config.negative_prompt and config.true_cfg_scale <= 1.0:
        raise UserError("--negative_prompt has no effect on FLUX unless --true_cfg_scale > 1 "
                        "(e.g. --true_cfg_scale 4)")
    multiple = SIZE_MULTIPLE[model_type]
    for flag in ("width", "height"):
        value = getattr(config, flag)
        if value is not None and value % multiple:
            raise UserError(f"--{flag} {value}: {model_type.upper()} needs a multiple of {multiple} "
                            f"(e.g. {max(multiple, value // multiple * multiple)})")


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


def _control_image(config: GenerateConfig) -> Image.Image | None:
    if config.control_image is None:
        return None
    path = Path(config.control_image).expanduser()
    if not path.is_file():
        raise UserError(f"--control_image {path}: file not found; check the path")
    return load_rgb(path)


def _output_dir(config: GenerateConfig) -> Path:
    path = Path(config.output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"--output_dir {path} is a file; give a folder")
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_settings(config: GenerateConfig, model_type: str, pipe: Any,
                     control: Image.Image | None) -> dict[str, Any]:
    """Steps, guidance and size with the model's defaults filled in."""
    if model_type == "sdxl":
        steps, guidance = SDXL_DEFAULTS["steps"], SDXL_DEFAULTS["guidance_scale"]
    else:
        distilled = pipe.transformer.config.guidance_embeds
        steps, guidance = (28, 3.5) if distilled else (4, 0.0)
    if control is not None:
        multiple = SIZE_MULTIPLE[model_type]
        native = (control.width // multiple * multiple, control.height // multiple * multiple)
    else:
        native = (default_size(pipe),) * 2
    width = config.width or (config.height if config.height else native[0])
    height = config.height or (config.width if config.width else native[1])
    return {"steps": config.steps or steps, "guidance_scale": config.guidance_scale if config.guidance_scale
            is not None else guidance, "width": width, "height": height}


def _pipeline_kwargs(config: GenerateConfig, model_type: str, settings: dict[str, Any],
                     control: Image.Image | None) -> dict[str, Any]:
    kwargs = {"num_inference_steps": settings["steps"], "guidance_scale": settings["guidance_scale"],
              "width": settings["width"], "height": settings["height"],
              "negative_prompt": config.negative_prompt}
    if model_type == "flux":
        kwargs["true_cfg_scale"] = config.true_cfg_scale
    if control is not None:
        kwargs.update(control_image=control, controlnet_conditioning_scale=config.controlnet_conditioning_scale)
    return kwargs


def image_parameters(config: GenerateConfig, model_type: str, settings: dict[str, Any], loras: list[LoraSpec],
                     dtype: torch.dtype, prompt: str, seed: int) -> dict[str, Any]:
    """Everything needed to make the image again: stored in its PNG."""
    params: dict[str, Any] = {
        "model_type": model_type, "model": config.model, "model_config": config.model_config,
        "prompt": prompt, "negative_prompt": config.negative_prompt, "seed": seed, "sampler": "Euler",
        **settings, "loras": [{"path": str(s.path), "weight": s.weight} for s in loras], "merge": config.merge,
        "dtype": str(dtype).removeprefix("torch."), "dreamstep_version": __version__,
    }
    if model_type == "flux":
        params["true_cfg_scale"] = config.true_cfg_scale
    if config.controlnet is not None:
        params.update(controlnet=config.controlnet, control_image=config.control_image,
                      controlnet_conditioning_scale=config.controlnet_conditioning_scale)
    return params


def _batches(prompts: list[str], num_images: int, batch_size: int, first_seed: int) -> list[tuple[str, list[int]]]:
    """(prompt, seeds) per pipeline call; seeds run on across prompts so every image has its own."""
    calls, seed = [], first_seed
    for prompt in prompts:
        for start in range(0, num_images, batch_size):
            count = min(batch_size, num_images - start)
            calls.append((prompt, list(range(seed, seed + count))))
            seed += count
    return calls


def generate_images(config: GenerateConfig, model_type: str) -> list[Path]:
    """Generate every image ``config`` asks for with ``model_type`` ('flux' or 'sdxl'); return the PNG paths.
    All input is checked before the model loads."""
    check_for_model(config, model_type)
    prompts = read_prompts(config)
    loras = [parse_lora_spec(text) for text in config.lora]
    control = _control_image(config)
    output_dir = _output_dir(config)
    device = choose_device(config.device)
    dtype = choose_dtype(config.dtype, device)
    pipe = build_pipeline(model_type, config.model, model_config=config.model_config, dtype=dtype, device=device,
                          no_half_vae=config.no_half_vae, controlnet=config.controlnet,
                          cpu_offload=config.cpu_offload)
    apply_loras(pipe, loras, model_type, config.merge)
    settings = resolve_settings(config, model_type, pipe, control)
    kwargs = _pipeline_kwargs(config, model_type, settings, control)
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
                params = image_parameters(config, model_type, settings, loras, dtype, prompt, seed)
                written.append(save_png(image, output_dir, index, params))
                index += 1
    return written
