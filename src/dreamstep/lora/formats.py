"""LoRA key layouts as data: which module of one layout is which module of another.

Three layouts name the same LoRA differently:

* **kohya** (sd-scripts): ``<prefix>_<module path with '.' -> '_'>.lora_down.weight`` / ``.lora_up.weight`` /
  ``.alpha``. FLUX modules are the BFL (original) ones, where q, k, v (and the single blocks' MLP input) are
  one fused Linear; SDXL UNet modules use the SGM names (``input_blocks.4.1...``).
* **diffusers** (PEFT): ``<component>.<diffusers module>.lora_A.weight`` / ``.lora_B.weight``; alpha lives in
  the ``lora_adapter_metadata`` safetensors header (a PEFT ``LoraConfig`` per component) or is folded in.
  An SDXL UNet may come in diffusers' older attention-processor names (see :func:`legacy_unet_key`).
* **mindspore** (the mindone port, SDXL): ``<kohya prefix>.<diffusers module>.lora_down.weight`` / ... .

Which module of one layout is which module of another is each family's own fact (its ``lora_keys``,
:mod:`dreamstep.models.family`); :func:`model_keys` asks the family for the tables of one concrete model (its
block and layer counts), which :mod:`dreamstep.lora.convert` maps through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from dreamstep.errors import UserError
from dreamstep.models.family import get_family
from dreamstep.models.lora_keys import ModelKeys

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

# Tensor suffixes, per layout: (down, up). Kohya "down" is PEFT "lora_A" (rank, in); "up" is "lora_B" (out, rank).
KOHYA_SUFFIXES: Final = (".lora_down.weight", ".lora_up.weight")
DIFFUSERS_SUFFIXES: Final = (".lora_A.weight", ".lora_B.weight")
ALPHA_SUFFIX: Final = ".alpha"

# diffusers' older names for SDXL UNet LoRA tensors: '<attention>.processor.to_q_lora.down.weight' ('to_out.0'
# as 'to_out'), any other module '<module>.lora.down.weight'. diffusers still reads them, and they are the
# only names under which ComfyUI maps SDXL attention layers.
_LEGACY_UNET_KEY = re.compile(r"^(unet\..+?)(?:\.processor\.(to_[qkv]|to_out)_lora|\.lora)\.(down|up)\.weight$")
_COMFYUI_KEY = re.compile(r"^diffusion_model\.(.+?)\.(lora_down\.weight|lora_up\.weight|alpha)$")
_PEFT_UNET_KEY = re.compile(r"^(unet\..+?)(\.(to_[qkv]|to_out\.0))?\.lora_(A|B)\.weight$")


def legacy_unet_key(key: str) -> str:
    """A PEFT-named SDXL UNet key ('unet.<module>.lora_A.weight') in diffusers' older names, which both
    diffusers and ComfyUI read; other keys unchanged."""
    match = _PEFT_UNET_KEY.match(key)
    if match is None:
        return key
    module, _, projection, role = match.groups()
    role = "down" if role == "A" else "up"
    if projection is not None and module.split(".")[-1].startswith("attn"):
        return f"{module}.processor.{projection.removesuffix('.0')}_lora.{role}.weight"
    return f"{module}{match[2] or ''}.lora.{role}.weight"


def comfyui_as_peft(tensors: Mapping[str, Any]) -> dict[str, Any] | None:
    """A file in ComfyUI's ``diffusion_model.<diffusers module>.lora_down.weight`` / ``.lora_up.weight`` /
    ``.alpha`` layout (what dreamstep writes for a model ComfyUI names as diffusers does, Qwen-Image) under PEFT's
    names for the transformer; ``None`` for any other file (other families' ComfyUI files, in ``lora_A``/``lora_B``
    under their released names, are their families' to read)."""
    matches = [_COMFYUI_KEY.match(key) for key in tensors]
    if not all(matches) or not any(m.group(2) == "lora_down.weight" for m in matches):
        return None
    roles = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight", "alpha": "alpha"}
    return {f"transformer.{m.group(1)}.{roles[m.group(2)]}": tensor for m, tensor in zip(matches, tensors.values())}


def peft_key(key: str) -> str:
    """An SDXL UNet key in diffusers' older names as PEFT names it (the inverse of :func:`legacy_unet_key`);
    other keys unchanged."""
    match = _LEGACY_UNET_KEY.match(key)
    if match is None:
        return key
    module, projection, role = match.groups()
    if projection is not None:
        module += ".to_out.0" if projection == "to_out" else f".{projection}"
    return f"{module}.lora_{'A' if role == 'down' else 'B'}.weight"


# The safetensors header key under which diffusers stores each component's PEFT LoraConfig (JSON),
# flattened as "<component>.<field>" (diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY).
ADAPTER_METADATA_KEY: Final = "lora_adapter_metadata"

def kohya_prefixes(model: str) -> Mapping[str, str]:
    """sd-scripts' (and MindSpore's) file prefix -> diffusers pipeline component, for family ``model``."""
    return get_family(model).kohya_prefixes


def model_keys(model: str, configs: Mapping[str, Mapping] | None = None) -> ModelKeys:
    """Tables for family ``model`` from component configs (see :func:`folder_configs`); without configs, for the
    released model."""
    found = get_family(model)
    if configs and found.denoiser not in configs:
        raise UserError(f"the base model has no {found.denoiser}/config.json, so it is not a {found.title} pipeline")
    return found.lora_keys(configs or None)


def folder_configs(base: str | Path) -> dict[str, dict]:
    """The ``config.json`` of each component of a diffusers pipeline folder."""
    base = Path(base)
    if not (base / "model_index.json").is_file():
        raise UserError(f"--base {base}: not a diffusers pipeline folder (no model_index.json)")
    return {d.name: json.loads((d / "config.json").read_text()) for d in sorted(base.iterdir())
            if (d / "config.json").is_file()}


def pipeline_configs(pipe: DiffusionPipeline) -> dict[str, dict]:
    """The configs of a loaded diffusers pipeline's components, as :func:`folder_configs` gives them."""
    out = {}
    for name, component in pipe.components.items():
        config = getattr(component, "config", None)
        if config is not None:
            out[name] = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return out
