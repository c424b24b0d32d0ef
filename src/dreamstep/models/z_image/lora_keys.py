"""Z-Image's LoRA key tables: the released checkpoint's module names (Tongyi-MAI's, which ComfyUI's and
sd-scripts-style files use) against diffusers'.

The released transformer fuses q, k and v of each block into one ``attention.qkv`` Linear and names the output
projection ``attention.out``; diffusers splits q, k, v and calls it ``attention.to_out.0``. Everything else in a
block (``feed_forward.w1/w2/w3``, ``adaLN_modulation.0``) has one name in both.

ComfyUI reads a Z-Image LoRA (``comfy/lora.py``'s Lumina2 branch, built from ``comfy/utils.z_image_to_diffusers``)
under ``diffusion_model.<diffusers module>`` (also ``transformer.``, ``lycoris_`` or bare): a diffusers q, k or v
module lands on its third of the fused ``qkv`` rows. The ComfyUI file dreamstep writes is that layout, which
diffusers' Z-Image loader reads too (it drops the ``diffusion_model.`` prefix).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from dreamstep.models.lora_keys import ModelKeys, ModuleMap, kohya_name, text_encoder_maps
from dreamstep.models.z_image import configs

COMFYUI_PREFIX: Final = "diffusion_model."

# Released module inside a block -> diffusers modules; several mean one fused Linear whose rows are the parts.
BLOCK: Final[dict[str, tuple[str, ...]]] = {
    "attention.qkv": ("attention.to_q", "attention.to_k", "attention.to_v"),
    "attention.out": ("attention.to_out.0",),
    "feed_forward.w1": ("feed_forward.w1",),
    "feed_forward.w2": ("feed_forward.w2",),
    "feed_forward.w3": ("feed_forward.w3",),
    "adaLN_modulation.0": ("adaLN_modulation.0",),
}
FUSED_ROWS: Final = {"attention.qkv": (1, 1, 1)}
# Qwen3's adapted linears per layer ``{i}``.
QWEN3_LAYER: Final = tuple(f"layers.{{i}}.{m}" for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj"))


def block_groups(transformer: Mapping) -> tuple[tuple[str, int, bool], ...]:
    """(group, block count, has adaLN modulation) of a transformer config: the main blocks and the noise refiner
    are modulated by the timestep, the context refiner is not."""
    refiners = transformer.get("n_refiner_layers", configs.TRANSFORMER["n_refiner_layers"])
    return (("layers", transformer.get("n_layers", configs.TRANSFORMER["n_layers"]), True),
            ("noise_refiner", refiners, True), ("context_refiner", refiners, False))


def z_image_keys(transformer: Mapping | None = None,
                 text_layers: int = configs.TEXT_ENCODER["num_hidden_layers"]) -> ModelKeys:
    """The tables of a transformer config (default: the released Z-Image's)."""
    cfg = {**configs.TRANSFORMER, **(transformer or {})}
    maps = []
    for group, count, modulated in block_groups(cfg):
        for i in range(count):
            for released, parts in BLOCK.items():
                if released.startswith("adaLN") and not modulated:
                    continue
                maps.append(ModuleMap(kohya_name("lora_unet", f"{group}.{i}.{released}"),
                                      tuple(f"transformer.{group}.{i}.{p}" for p in parts),
                                      FUSED_ROWS.get(released, (1,))))
    # ComfyUI's names of the same modules (its layout is diffusers' under another prefix), first: a Kohya name
    # converts to the diffusers names that follow them.
    aliases = [ModuleMap(m.kohya, tuple(COMFYUI_PREFIX + d.removeprefix("transformer.") for d in m.diffusers), m.rows)
               for m in maps]
    maps = aliases + maps + text_encoder_maps("lora_te1", "text_encoder", QWEN3_LAYER, text_layers)
    return ModelKeys("z-image", f"Z-Image transformer with {cfg['n_layers']} blocks and "
                                f"{cfg['n_refiner_layers']} + {cfg['n_refiner_layers']} refiners", tuple(maps))


def keys_from_configs(configs_: Mapping[str, Mapping]) -> ModelKeys:
    return z_image_keys(configs_.get("transformer"), configs_.get("text_encoder", {}).get(
        "num_hidden_layers", configs.TEXT_ENCODER["num_hidden_layers"]))


def comfyui_state_dict(diffusers_state: Mapping[str, object]) -> dict[str, object]:
    """A diffusers-layout LoRA state dict (``transformer.<module>.lora_A.weight`` ...) in ComfyUI's layout."""
    return {COMFYUI_PREFIX + key.removeprefix("transformer."): value for key, value in diffusers_state.items()}
