"""Krea 2's LoRA key tables: the released checkpoint's module names (krea-ai's, which ComfyUI's files use, under
``diffusion_model.``) against diffusers'. Nothing is fused: each diffusers module is one released module.

ComfyUI (``comfy/utils.krea2_to_diffusers``) and diffusers' Krea 2 loader map ``blocks.{i}.attn.wq/wk/wv/wo/gate``
and ``blocks.{i}.mlp.gate/up/down`` onto ``transformer_blocks.{i}.attn.to_q/to_k/to_v/to_out.0/to_gate`` and
``transformer_blocks.{i}.ff.gate/up/down``, the text fusion's blocks likewise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from dreamstep.models.krea2 import configs
from dreamstep.models.lora_keys import ModelKeys, ModuleMap, kohya_name

COMFYUI_PREFIX: Final = "diffusion_model."
# diffusers module inside a block -> the released module.
BLOCK: Final[dict[str, str]] = {
    "attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_out.0": "attn.wo",
    "attn.to_gate": "attn.gate", "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down",
}


def block_groups(transformer: Mapping) -> tuple[tuple[str, str, int], ...]:
    """(diffusers group, released group, block count) of a transformer config."""
    cfg = {**configs.TRANSFORMER, **transformer}
    return (("transformer_blocks", "blocks", cfg["num_layers"]),
            ("text_fusion.layerwise_blocks", "txtfusion.layerwise_blocks", cfg["num_layerwise_text_blocks"]),
            ("text_fusion.refiner_blocks", "txtfusion.refiner_blocks", cfg["num_refiner_text_blocks"]))


def released_names(transformer: Mapping | None = None) -> dict[str, str]:
    """{diffusers module: released module} of every block's adaptable Linear."""
    return {f"{ours}.{i}.{d}": f"{theirs}.{i}.{r}" for ours, theirs, count in block_groups(transformer or {})
            for i in range(count) for d, r in BLOCK.items()}


def krea2_keys(transformer: Mapping | None = None) -> ModelKeys:
    names = released_names(transformer)
    maps = [ModuleMap(kohya_name("lora_unet", released), (f"{COMFYUI_PREFIX}{released}",))
            for released in names.values()]  # ComfyUI's names, first: a Kohya name converts to diffusers'
    maps += [ModuleMap(kohya_name("lora_unet", released), (f"transformer.{ours}",)) for ours, released in names.items()]
    cfg = {**configs.TRANSFORMER, **(transformer or {})}
    return ModelKeys("krea2", f"Krea 2 transformer with {cfg['num_layers']} blocks", tuple(maps))


def comfyui_state_dict(diffusers_state: Mapping[str, object], transformer: Mapping | None = None) -> dict[str, object]:
    """A diffusers-layout LoRA state dict (``transformer.<module>.lora_A.weight`` ...) in ComfyUI's layout."""
    names = released_names(transformer)
    out = {}
    for key, value in diffusers_state.items():
        module, _, tail = key.removeprefix("transformer.").partition(".lora_")
        out[f"{COMFYUI_PREFIX}{names[module]}.lora_{tail}"] = value
    return out
