"""The ``lora info`` report: what to check before loading a LoRA from elsewhere: its layout and target
model, whether its modules exist in that model with the right shapes, module count, rank and alpha per
module group, dtypes, and the metadata it carries.
"""

from __future__ import annotations

import collections
import json
import re

from dreamstep.errors import UserError
from dreamstep.lora import formats
from dreamstep.lora.convert import Lora, read_lora, to_diffusers
from dreamstep.lora.formats import comfyui_as_peft, folder_configs, model_keys
from dreamstep.lora.io import LoraFile, read_lora_file
from dreamstep.lora.lycoris_files import fit_problem, read_lycoris, report_lines
from dreamstep.lora.lycoris_network import is_lycoris
from dreamstep.models.family import families, model_title
from dreamstep.models.full_size import lora_shape_problem, weight_shapes

LAYOUT_NAMES = {
    "kohya": "Kohya sd-scripts layout (lora_down/lora_up/alpha)",
    "diffusers": "diffusers/PEFT layout (lora_A/lora_B)",
    "mindspore": "MindSpore port layout (dotted diffusers names, lora_down/lora_up/alpha)",
}
COMFYUI_LAYOUT_NAME = "ComfyUI layout (diffusion_model.<diffusers module>, lora_down/lora_up/alpha)"


def _group(lora: Lora, name: str) -> str:
    """The module name up to its first block index: 'lora_unet_double_blocks_0_img_attn_qkv' ->
    'lora_unet_double_blocks', 'unet.down_blocks.1.attentions.0.proj_in' -> 'unet.down_blocks'."""
    sep = "_" if lora.layout == "kohya" else r"\."
    match = re.match(rf"(.*?){sep}\d+(?={sep}|$)", name)
    return match.group(1) if match else name


def _component(lora: Lora, name: str) -> str:
    if lora.layout == "diffusers":
        return name.partition(".")[0]
    prefix = re.match(r"lora_(?:unet|te\d?)", name).group(0)
    return families()[lora.model].kohya_prefixes.get(prefix, prefix) if lora.model in families() else prefix


def _values(values: set) -> str:
    return ", ".join(f"{v:g}" for v in sorted(values))


def _metadata_lines(metadata: dict[str, str], width: int = 76) -> list[str]:
    lines = []
    for key, value in sorted(metadata.items()):
        if key == formats.ADAPTER_METADATA_KEY:
            try:
                components = sorted({k.partition(".")[0] for k in json.loads(value)})
                value = f"(PEFT adapter config for {', '.join(components)})"
            except (json.JSONDecodeError, AttributeError):
                value = "(not valid JSON: loaders that read alpha from it will fail)"
        value = " ".join(str(value).split())
        lines.append(f"  {key}: {value if len(value) <= width else value[:width - 3] + '...'}")
    return lines


def _fit(lora: Lora, base: str | None) -> str:
    """Whether every module exists in the model, with the shape of the layer there: against ``base``'s
    configs, or the released FLUX.1-dev / SDXL base 1.0, built on the meta device."""
    configs = folder_configs(base) if base else None
    keys = model_keys(lora.model, configs)
    target = f"the {keys.description}" + (f" of {base}" if base else f" ({families()[lora.model].released_name})")
    try:
        modules = to_diffusers(lora, keys)
    except UserError as e:
        return f"NO: {str(e).removeprefix(f'{lora.path}: ')}"
    shapes = weight_shapes(lora.model, configs)
    for name, m in modules.items():
        problem = lora_shape_problem(name, m.down, m.up, shapes)
        if problem is not None:
            return (f"NO: {problem} in {target}; the LoRA was trained on a model of another size "
                    f"(a small test model, or another variant){'' if base else '; give its folder with --base'}")
    return f"yes, every module exists with its shape in {target}"


def _describe_lycoris(lora_file: LoraFile, model: str | None, base: str | None) -> str:
    lycoris = read_lycoris(lora_file.path, model, lora_file)
    fits = None
    if lycoris.model is not None:
        configs = folder_configs(base) if base else None
        keys = model_keys(lycoris.model, configs)
        released = families()[lycoris.model].released_name
        target = f"the {keys.description}" + (f" of {base}" if base else f" ({released})")
        problem = fit_problem(lycoris, keys, weight_shapes(lycoris.model, configs))
        fits = f"yes, every module exists with its shape in {target}" if problem is None else (
            f"NO: {problem} in {target}{'' if base else '; give the model folder with --base'}")
    lines = [f"file:      {lycoris.path} ({lycoris.path.stat().st_size:,} bytes, {lycoris.container})",
             *report_lines(lycoris, fits),
             f"metadata:  {len(lycoris.metadata)} keys" + (":" if lycoris.metadata else "")]
    return "\n".join(lines + _metadata_lines(lycoris.metadata))


def _layout_name(lora: Lora, lora_file: LoraFile) -> str:
    return COMFYUI_LAYOUT_NAME if comfyui_as_peft(lora_file.tensors) is not None else LAYOUT_NAMES[lora.layout]


def describe(path: str, model: str | None = None, base: str | None = None) -> str:
    """The ``lora info`` report for one file."""
    lora_file = read_lora_file(path)
    if is_lycoris(lora_file.tensors):
        return _describe_lycoris(lora_file, model, base)
    lora = read_lora(path, model)
    size = lora.path.stat().st_size
    tensors = [t for m in lora.modules.values() for t in (m.down, m.up)]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    components = sorted({_component(lora, n) for n in lora.modules})
    target = model_title(lora.model) if lora.model else "unknown (text encoders only; pass --model)"
    lines = [
        f"file:      {lora.path} ({size:,} bytes, {lora.container})",
        f"format:    {lora.format}: {_layout_name(lora, lora_file)}",
        f"target:    {target}: {', '.join(components)}",
    ]
    if lora.model is not None:
        lines.append(f"fits:      {_fit(lora, base)}")
    lines += [f"modules:   {len(lora.modules)}", f"dtype:     {', '.join(dtypes)}", "groups:"]
    groups: dict[str, list] = collections.defaultdict(list)
    for name, m in lora.modules.items():
        groups[_group(lora, name)].append(m)
    width = max(len(g) for g in groups)
    for group, mods in groups.items():
        scales = {m.scale for m in mods}
        scale = f"scale {_values(scales)}" if len(scales) == 1 else "scales vary"
        modules = f"{len(mods):>4} module{'s' if len(mods) != 1 else ' '}"
        lines.append(f"  {group:<{width}}  {modules}  rank {_values({m.rank for m in mods})}  "
                     f"alpha {_values({m.alpha for m in mods})}  ({scale})")
    lines.append(f"metadata:  {len(lora.metadata)} keys" + (":" if lora.metadata else ""))
    lines += _metadata_lines(lora.metadata)
    return "\n".join(lines)
