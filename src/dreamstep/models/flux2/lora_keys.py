"""FLUX.2's LoRA key tables: Black Forest Labs' module names (sd-scripts' / ComfyUI's ``lora_unet_…`` files, which
ComfyUI maps onto its FLUX.2 weights and diffusers' ``Flux2LoraLoaderMixin`` reads) against diffusers'.

In BFL's double blocks q, k, v are one fused Linear that diffusers splits; the single blocks' fused q, k, v + MLP
input (``linear1``) is one Linear in diffusers too (``attn.to_qkv_mlp_proj``). FLUX.2 has no per-block modulation:
three shared modulation layers sit outside the blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from dreamstep.models.lora_keys import ModelKeys, ModuleMap, kohya_name

# BFL module inside ``double_blocks.{i}`` -> diffusers modules inside ``transformer_blocks.{i}`` (several: the
# parts of one fused BFL Linear, in its row order).
DOUBLE_BLOCK: Final[dict[str, tuple[str, ...]]] = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.linear_in",),
    "img_mlp.2": ("ff.linear_out",),
    "txt_mlp.0": ("ff_context.linear_in",),
    "txt_mlp.2": ("ff_context.linear_out",),
}
SINGLE_BLOCK: Final[dict[str, tuple[str, ...]]] = {
    "linear1": ("attn.to_qkv_mlp_proj",),
    "linear2": ("attn.to_out",),
}
# Output rows of each part of a fused module, in units of the hidden size (q, k, v are hidden x hidden).
FUSED_ROWS: Final[dict[str, tuple[int, ...]]] = {"img_attn.qkv": (1, 1, 1), "txt_attn.qkv": (1, 1, 1)}
# Modules outside the blocks. The final layer's adaLN modulation is left out: BFL orders it (shift, scale),
# diffusers (scale, shift).
GLOBAL: Final[dict[str, str]] = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
}
GUIDANCE: Final[dict[str, str]] = {
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
}
# FLUX.2 [klein] 4B's block counts, used when no model folder is given.
KLEIN_4B_BLOCKS: Final = {"num_layers": 5, "num_single_layers": 20, "guidance_embeds": False}


def flux2_keys(transformer: Mapping | None = None) -> ModelKeys:
    """The FLUX.2 tables for a transformer config (default: the released [klein] 4B, 5 + 20 blocks)."""
    cfg = {**KLEIN_4B_BLOCKS, **(transformer or {})}
    maps = []
    for kind, count, ours, table in (("double_blocks", cfg["num_layers"], "transformer_blocks", DOUBLE_BLOCK),
                                     ("single_blocks", cfg["num_single_layers"], "single_transformer_blocks",
                                      SINGLE_BLOCK)):
        for i in range(count):
            for bfl, parts in table.items():
                maps.append(ModuleMap(kohya_name("lora_unet", f"{kind}.{i}.{bfl}"),
                                      tuple(f"transformer.{ours}.{i}.{p}" for p in parts), FUSED_ROWS.get(bfl, (1,))))
    globals_ = {**GLOBAL, **(GUIDANCE if cfg["guidance_embeds"] else {})}
    maps += [ModuleMap(kohya_name("lora_unet", bfl), (f"transformer.{ours}",)) for bfl, ours in globals_.items()]
    desc = f"FLUX.2 transformer with {cfg['num_layers']} double and {cfg['num_single_layers']} single blocks"
    return ModelKeys("flux2", desc, tuple(maps))


def keys_from_configs(configs: Mapping[str, Mapping]) -> ModelKeys:
    """The tables of the model whose component configs are ``configs`` (no transformer config: [klein] 4B's)."""
    return flux2_keys(configs.get("transformer"))
