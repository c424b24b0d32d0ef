"""Whether a model source is there and of the right kind, checked at the door of every command before anything
loads: a diffusers folder (complete, its configs readable), a hub id (in the local cache when offline), a
single-file checkpoint. Nothing here imports diffusers or transformers, so a command that refuses its model does
so at once (loading them takes seconds)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from dreamstep.errors import UserError
from dreamstep.models.sdxl.sgm_keys import UNET_PREFIX

if TYPE_CHECKING:
    import torch

CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
# "owner/name" as on the hub; anything else that does not exist locally is a mistyped path.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Where diffusers takes an SDXL single file's configs and tokenizers when it is given none.
SDXL_BASE = "stabilityai/stable-diffusion-xl-base-1.0"

@dataclass
class FluxComponents:
    """The seven parts of a FLUX.1 pipeline, named as in ``FluxPipeline``."""

    tokenizer: Any
    tokenizer_2: Any
    text_encoder: torch.nn.Module
    text_encoder_2: torch.nn.Module
    vae: torch.nn.Module
    transformer: torch.nn.Module
    scheduler: Any


@dataclass
class SDXLComponents:
    """The seven parts of an SDXL pipeline, named as in ``StableDiffusionXLPipeline``."""

    tokenizer: Any
    tokenizer_2: Any
    text_encoder: torch.nn.Module
    text_encoder_2: torch.nn.Module
    vae: torch.nn.Module
    unet: torch.nn.Module
    scheduler: Any


def check_pipeline_folder(folder: Path, cls: type, pipeline: str) -> None:
    """Fail early, naming the folder, when it is not a complete ``pipeline`` folder."""
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise UserError(f"{folder} is not a diffusers pipeline folder (no model_index.json); give "
                        f"the folder that holds model_index.json, or a hub id")
    index = json_file(index_path)
    missing = [name for name in cls.__dataclass_fields__
               if not isinstance(index.get(name), list) or index[name][0] is None]
    if missing:
        found = index.get("_class_name", "an unknown pipeline")
        raise UserError(f"{folder} holds {found}, not a {pipeline}: model_index.json has no "
                        f"{', '.join(missing)}; give a {pipeline} folder")
    absent = [name for name in cls.__dataclass_fields__ if not (folder / name).is_dir()]
    if absent:
        raise UserError(f"{folder} is incomplete: no {', '.join(s + '/' for s in absent)} folder "
                        "listed in model_index.json; copy or download the whole pipeline folder")
    for name in cls.__dataclass_fields__:
        for config in sorted((folder / name).glob("*config.json")):
            json_file(config)


def json_file(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise UserError(f"{path} is not a readable JSON file ({e}); re-download or repair it") from e
    if not isinstance(found, dict):
        raise UserError(f"{path} holds a JSON {type(found).__name__}, not an object; re-download or repair it")
    return found


def folder_or_hub_id(source: str | Path, cls: type, pipeline: str) -> str:
    """Return ``source`` for ``from_pretrained``: a checked local folder, or a hub id."""
    path = Path(source).expanduser()
    if path.is_dir():
        check_pipeline_folder(path, cls, pipeline)
        return str(path)
    if path.exists():
        raise UserError(f"'{source}' is a file, not a {pipeline} folder; give the folder that holds "
                        "model_index.json")
    if isinstance(source, str) and HUB_ID.match(source) and not source.endswith(CHECKPOINT_SUFFIXES):
        return source
    raise UserError(f"model path '{source}' does not exist; give a {pipeline} folder or a "
                    "Hugging Face hub id such as 'owner/model'")


def check_pipeline_source(source: str | Path, arch: str, flag: str = "--pretrained_model_name_or_path", *,
                          configs_given: bool = False) -> None:
    """Fail with one line naming ``flag``, before anything loads, when ``source`` is neither a complete diffusers
    folder of ``arch`` ("flux" or "sdxl"), a single-file SDXL checkpoint, nor a hub id (in the local cache when
    HF_HUB_OFFLINE is set). ``configs_given``: a single file's configs come from ``--model_config``."""
    try:
        if arch == "sdxl" and is_single_file(source):
            file = check_checkpoint_file(source, "SDXL checkpoint")
            if file.suffix == ".safetensors":
                check_sdxl_safetensors(file)
            if not configs_given and not (file.parent / "model_index.json").is_file():
                _check_in_reach(SDXL_BASE, f"{file} is a lone single file (no --model_config, no "
                                           "model_index.json beside it): diffusers takes its configs and tokenizers "
                                           f"from {SDXL_BASE}", "give --model_config a diffusers SDXL folder")
            return
        cls, pipeline = ((FluxComponents, "FluxPipeline") if arch == "flux"
                         else (SDXLComponents, "StableDiffusionXLPipeline") if arch == "sdxl"
                         else _family_parts(arch))
        name = folder_or_hub_id(source, cls, pipeline)
        if not Path(name).expanduser().is_dir():
            _check_in_reach(name, f"'{name}' is a hub id, not a local folder", "give a local folder")
    except UserError as e:
        raise UserError(f"{flag}: {e}") from None


def _check_in_reach(hub_id: str, what: str, fix: str) -> None:
    """Offline, the hub model ``hub_id`` must be in the Hugging Face cache."""
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import try_to_load_from_cache

    if hf_constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(hub_id, "model_index.json"), str):
        raise UserError(f"{what}; {hub_id} is not in the Hugging Face cache while HF_HUB_OFFLINE is set: {fix}, "
                        "or unset HF_HUB_OFFLINE to download it")


def _family_parts(name: str) -> tuple[type, str]:
    """The parts a folder of another family must have (its ``component_labels``) and its first pipeline class."""
    from dreamstep.models.family import get_family

    found = get_family(name)
    return dataclasses.make_dataclass(f"{found.name}_parts", list(found.component_labels)), found.pipeline_classes[0]


def check_checkpoint_file(path: str | Path, what: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{what} {file} does not exist; check the path")
    if file.suffix not in CHECKPOINT_SUFFIXES:
        raise UserError(f"{what} {file} is not a checkpoint (expected one of "
                        f"{', '.join(CHECKPOINT_SUFFIXES)})")
    return file


def check_sdxl_safetensors(file: Path) -> None:
    """Read only the header: is this an SDXL checkpoint in the original (SGM) layout?"""
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
    except (SafetensorError, OSError) as e:
        raise UserError(f"{file} is not a readable .safetensors file ({e}); re-download it") from e
    if not any(key.startswith(UNET_PREFIX) for key in keys):
        raise UserError(f"{file} is not an SDXL single-file checkpoint: it has no '{UNET_PREFIX}*' "
                        "keys (a LoRA or a lone UNet/VAE file?); give a full checkpoint such as "
                        "sd_xl_base_1.0.safetensors, or a diffusers folder")


def is_single_file(path_or_id: str | Path) -> bool:
    """Whether ``path_or_id`` names a single-file checkpoint rather than a diffusers folder or hub id."""
    return Path(path_or_id).expanduser().is_file() or str(path_or_id).endswith(CHECKPOINT_SUFFIXES)


def check_model_config(model: str, model_config: str | None, single_file: bool) -> None:
    """``--model_config`` supplies a single file's other components; a folder or hub id has its own."""
    if model_config is not None and not single_file:
        raise UserError(f"--model_config only applies to a single-file --model ({model} is a folder or hub id, "
                        "with its own configs); remove it")
