"""The FLUX.1 pipelines that generate: ``FluxPipeline``, ``FluxControlNetPipeline`` with a ControlNet, and
``FluxKontextPipeline``, from a diffusers folder, a hub id or a single file with its component files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxKontextPipeline, FluxPipeline
from PIL import Image
from safetensors.torch import load_file

from dreamstep.config.schema import load_toml
from dreamstep.errors import UserError, refusing_pickled_code
from dreamstep.models.flux import controlnet as cn
from dreamstep.models.flux.files import FILE_SUFFIXES, resolve_base
from dreamstep.models.flux.kontext import edit_size
from dreamstep.models.flux.plumbing import FLUX_DEV_SAMPLING
from dreamstep.models.loading import load_flux
from dreamstep.models.sources import check_model_config, check_pipeline_source, is_single_file

# Where a single-file --model takes its other components and configs when --model_config is not given.
DEFAULT_BASES = {"flux": "black-forest-labs/FLUX.1-dev", "flux-kontext": "black-forest-labs/FLUX.1-Kontext-dev"}
# The variant whose pipeline takes a ControlNet (dreamstep's ControlNets are FLUX.1's).
CONTROLNET_VARIANT = "flux"
# A model without guidance embedding (FLUX.1-schnell) is distilled to a few steps and no guidance.
UNGUIDED_SAMPLING = {"steps": 4, "guidance_scale": 0.0}


def check_model(model: str, model_config: str | None, component_files: Mapping[str, str]) -> None:
    """One line naming --model, --model_config or a component file's flag when it is not there."""
    check_model_config(model, model_config, _single_file(model))
    if not _single_file(model):
        check_pipeline_source(model, "flux", "--model")
    elif model_config is not None:
        check_pipeline_source(model_config, "flux", "--model_config")
    if component_files:
        resolve_base(model, model_config=model_config, **component_files)


def pipeline(variant: str, model: str, *, model_config: str | None, dtype: torch.dtype,
             component_files: Mapping[str, str], controlnet: Any | None) -> Any:
    """``controlnet``: a ControlNet folder (``save_pretrained``'s layout), or a flux-controlnet run's checkpoint (an
    object with ``path``, its weights, and ``config_dir``, the run folder with ``config.toml``)."""
    beside = (Path(model).expanduser().parent / "model_index.json").is_file()
    if _single_file(model) and model_config is None and not beside and len(component_files) < 3:
        model_config = DEFAULT_BASES[variant]  # the parts no file gives, from the hub (or its cache)
    base = resolve_base(model, model_config=model_config, **component_files)
    parts = vars(load_flux(base.source, files=base.files, weight_dtype=dtype))
    if variant == "flux-kontext":
        return FluxKontextPipeline(**parts)
    if controlnet is None:
        return FluxPipeline(**parts)
    if isinstance(controlnet, str):
        return FluxControlNetPipeline(**parts, controlnet=load_controlnet(controlnet, dtype))
    return FluxControlNetPipeline(**parts, controlnet=controlnet_from_checkpoint(
        controlnet.path, controlnet.config_dir, parts["transformer"], dtype))


def _single_file(model: str) -> bool:
    return is_single_file(model) or model.endswith(FILE_SUFFIXES)


def load_controlnet(folder: str, dtype: torch.dtype) -> FluxControlNetModel:
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


def controlnet_from_checkpoint(weights: Path, run_dir: Path, transformer: torch.nn.Module,
                               dtype: torch.dtype) -> FluxControlNetModel:
    """The ControlNet of a flux-controlnet run's ``checkpoint-N``, with the checkpoint's ``weights``, shaped as the
    run's: built from the base transformer (the block counts of ``run_dir/config.toml``), or for a run that started
    from a ControlNet (``--controlnet_model_name_or_path``) that one's architecture."""
    run = load_toml(run_dir / "config.toml")
    start = run.get("controlnet_model_name_or_path")
    if start is None:
        model = cn.build_from_transformer(transformer, run.get("num_double_layers", 4), run.get("num_single_layers", 4))
    else:
        model = FluxControlNetModel.from_config(_started_from(run_dir, run, start))
    model.load_state_dict(load_file(str(weights)))
    return model.to(dtype)


def _started_from(run_dir: Path, run: dict[str, Any], start: str) -> dict[str, Any]:
    """The config of the ControlNet a run started from: the run's own ``config.json`` (written with its final
    ControlNet), else that of ``start`` (a folder, relative ones read from where training ran, or a hub id)."""
    from dreamstep.evaluation.candidates import training_folder

    folder = run_dir if (run_dir / "config.json").is_file() else training_folder(run_dir, run["output_dir"]) / start
    try:
        return FluxControlNetModel.load_config(str(folder if folder.is_dir() else start))
    except (OSError, ValueError) as e:
        raise UserError(f"{run_dir}: its checkpoints continue the ControlNet {start} (--controlnet_model_name_or_"
                        f"path), whose config.json cannot be read ({e}); put that folder back, or finish the run")


def sampling_defaults(variant: str, pipe: Any, images: Sequence[Image.Image]) -> dict[str, Any]:
    """Steps and guidance (FLUX.1-dev's, or few steps without guidance for a model without guidance embedding),
    and the size: a Kontext edit's training resolution nearest the image's aspect ratio, a ControlNet's control
    image's size, else the model's native size."""
    sampling = FLUX_DEV_SAMPLING if pipe.transformer.config.guidance_embeds else UNGUIDED_SAMPLING
    if variant == "flux-kontext" and images:
        width, height = edit_size(images[0].size, keep=False)
    elif images:
        width, height = images[0].width // 16 * 16, images[0].height // 16 * 16
    else:
        width = height = pipe.default_sample_size * pipe.vae_scale_factor
    return {"steps": sampling["steps"], "guidance_scale": sampling["guidance_scale"], "width": width,
            "height": height}


def image_inputs(variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
    """Kontext edits the image at the size asked for (its pipeline would scale it to 1024² of area); the ControlNet
    pipeline takes a control image."""
    if not images:
        return {}
    if variant == "flux-kontext":
        return {"image": images[0], "max_area": width * height, "_auto_resize": False}
    return {"control_image": images[0]}
