"""FLUX.1's LoRA key tables: Black Forest Labs' module names (sd-scripts' and ComfyUI's files) against diffusers'.

In BFL's transformer q, k, v (and a single block's MLP input) are one fused Linear; diffusers splits them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from dreamstep.models.lora_keys import CLIP_LAYER, ModelKeys, ModuleMap, kohya_name, text_encoder_maps

# BFL module inside ``double_blocks.{i}`` -> diffusers modules inside ``transformer_blocks.{i}``.
# Several diffusers modules mean one fused BFL Linear whose output rows are the parts, in this order.
FLUX_DOUBLE_BLOCK: Final[dict[str, tuple[str, ...]]] = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
    "img_mod.lin": ("norm1.linear",),
    "txt_mod.lin": ("norm1_context.linear",),
}

# BFL module inside ``single_blocks.{i}`` -> diffusers modules inside ``single_transformer_blocks.{i}``.
FLUX_SINGLE_BLOCK: Final[dict[str, tuple[str, ...]]] = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}

# Output rows of each part of a fused module, in units of the module's input width (the hidden size):
# q, k, v are hidden x hidden; FLUX's single-block MLP is 4 x hidden (mlp_ratio 4).
FLUX_FUSED_ROWS: Final[dict[str, tuple[int, ...]]] = {
    "img_attn.qkv": (1, 1, 1),
    "txt_attn.qkv": (1, 1, 1),
    "linear1": (1, 1, 1, 4),
}

# Modules outside the blocks (sd-scripts trains them with its ``train_t5xxl``/``in_dims`` options).
# The final layer's adaLN modulation is left out: BFL orders it (shift, scale), diffusers (scale, shift).
FLUX_GLOBAL: Final[dict[str, str]] = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
FLUX_GUIDANCE: Final[dict[str, str]] = {
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
}

# T5's adapted linears per layer ``{i}`` (sd-scripts' ``lora_te3``).
T5_LAYER: Final = tuple(
    f"encoder.block.{{i}}.{m}"
    for m in ("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
              "layer.0.SelfAttention.o", "layer.1.DenseReluDense.wi_0", "layer.1.DenseReluDense.wi_1",
              "layer.1.DenseReluDense.wo")
)

# Layer counts of the released FLUX.1, used when no base model folder is given.
FLUX_DEFAULTS: Final = {"num_layers": 19, "num_single_layers": 38, "guidance_embeds": True,
                        "clip_layers": 12, "t5_layers": 24}


def flux_keys(transformer: Mapping | None = None, clip_layers: int = FLUX_DEFAULTS["clip_layers"],
              t5_layers: int = FLUX_DEFAULTS["t5_layers"]) -> ModelKeys:
    """The FLUX.1 tables for a transformer config (default: the released FLUX.1 with 19 + 38 blocks)."""
    cfg = {**FLUX_DEFAULTS, **(transformer or {})}
    maps = []
    for kind, count, ours in (("double_blocks", cfg["num_layers"], "transformer_blocks"),
                              ("single_blocks", cfg["num_single_layers"], "single_transformer_blocks")):
        table = FLUX_DOUBLE_BLOCK if kind == "double_blocks" else FLUX_SINGLE_BLOCK
        for i in range(count):
            for bfl, parts in table.items():
                maps.append(ModuleMap(kohya_name("lora_unet", f"{kind}.{i}.{bfl}"),
                                      tuple(f"transformer.{ours}.{i}.{p}" for p in parts),
                                      FLUX_FUSED_ROWS.get(bfl, (1,))))
    globals_ = {**FLUX_GLOBAL, **(FLUX_GUIDANCE if cfg["guidance_embeds"] else {})}
    maps += [ModuleMap(kohya_name("lora_unet", bfl), (f"transformer.{ours}",)) for bfl, ours in globals_.items()]
    maps += text_encoder_maps("lora_te1", "text_encoder", CLIP_LAYER, clip_layers)
    maps += text_encoder_maps("lora_te3", "text_encoder_2", T5_LAYER, t5_layers)
    desc = f"FLUX.1 transformer with {cfg['num_layers']} double and {cfg['num_single_layers']} single blocks"
    return ModelKeys("flux", desc, tuple(maps))


def keys_from_configs(configs: Mapping[str, Mapping]) -> ModelKeys:
    """The tables of the model whose component configs are ``configs`` (missing ones: the released model's)."""
    return flux_keys(configs.get("transformer"),
                     configs.get("text_encoder", {}).get("num_hidden_layers", FLUX_DEFAULTS["clip_layers"]),
                     configs.get("text_encoder_2", {}).get("num_layers", FLUX_DEFAULTS["t5_layers"]))
