"""LoRA key layouts as data: which module of one layout is which module of another.

Three layouts name the same LoRA differently:

* **kohya** (sd-scripts): ``<prefix>_<module path with '.' -> '_'>.lora_down.weight`` / ``.lora_up.weight`` /
  ``.alpha``. FLUX modules are the BFL (original) ones, where q, k, v (and the single blocks' MLP input) are
  one fused Linear; SDXL UNet modules use the SGM names (``input_blocks.4.1...``).
* **diffusers** (PEFT): ``<component>.<diffusers module>.lora_A.weight`` / ``.lora_B.weight``; alpha lives in
  the ``lora_adapter_metadata`` safetensors header (a PEFT ``LoraConfig`` per component) or is folded in.
* **mindspore** (the mindone port, SDXL): ``<kohya prefix>.<diffusers module>.lora_down.weight`` / ... .

Everything here is a fact about those formats; :mod:`dreamstep.lora.convert` turns it into concrete tables.
"""

from __future__ import annotations

from typing import Final

# Tensor suffixes, per layout: (down, up). Kohya "down" is PEFT "lora_A" (rank, in); "up" is "lora_B" (out, rank).
KOHYA_SUFFIXES: Final = (".lora_down.weight", ".lora_up.weight")
DIFFUSERS_SUFFIXES: Final = (".lora_A.weight", ".lora_B.weight")
ALPHA_SUFFIX: Final = ".alpha"

# The safetensors header key under which diffusers stores each component's PEFT LoraConfig (JSON),
# flattened as "<component>.<field>" (diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY).
ADAPTER_METADATA_KEY: Final = "lora_adapter_metadata"

# Kohya (and MindSpore) prefix -> diffusers pipeline component, per model.
KOHYA_PREFIXES: Final[dict[str, dict[str, str]]] = {
    "flux": {"lora_unet": "transformer", "lora_te1": "text_encoder", "lora_te3": "text_encoder_2"},
    "sdxl": {"lora_unet": "unet", "lora_te1": "text_encoder", "lora_te2": "text_encoder_2"},
}

MODEL_NAMES: Final = {"flux": "FLUX.1", "sdxl": "SDXL", "sd1": "Stable Diffusion 1.x/2.x"}

# FLUX, BFL module inside ``double_blocks.{i}`` -> diffusers modules inside ``transformer_blocks.{i}``.
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

# FLUX, BFL module inside ``single_blocks.{i}`` -> diffusers modules inside ``single_transformer_blocks.{i}``.
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

# FLUX modules outside the blocks (sd-scripts trains them with its ``train_t5xxl``/``in_dims`` options).
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

# Text encoders keep their Hugging Face module names in every layout; per layer ``{i}``:
CLIP_LAYER: Final = tuple(
    f"text_model.encoder.layers.{{i}}.{m}"
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
)
T5_LAYER: Final = tuple(
    f"encoder.block.{{i}}.{m}"
    for m in ("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
              "layer.0.SelfAttention.o", "layer.1.DenseReluDense.wi_0", "layer.1.DenseReluDense.wi_1",
              "layer.1.DenseReluDense.wo")
)

# Layer counts of the released models, used when no base model folder is given.
FLUX_DEFAULTS: Final = {"num_layers": 19, "num_single_layers": 38, "guidance_embeds": True,
                        "clip_layers": 12, "t5_layers": 24}
SDXL_CLIP_LAYERS: Final = {"text_encoder": 12, "text_encoder_2": 32}

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json: the structure the SGM names are computed from.
SDXL_UNET_CONFIG: Final[dict] = {
    "act_fn": "silu",
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "center_input_sample": False,
    "class_embed_type": None,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_attention_heads": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816,
    "resnet_time_scale_shift": "default",
    "sample_size": 128,
    "time_embedding_type": "positional",
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None,
    "use_linear_projection": True,
}

# Names that give away which model a file was made for, per layout (checked in this order).
MODEL_HINTS: Final[tuple[tuple[str, str], ...]] = (
    ("double_blocks", "flux"), ("single_blocks", "flux"), ("lora_te3", "flux"),
    ("single_transformer_blocks", "flux"), ("transformer.transformer_blocks", "flux"),
    ("input_blocks", "sdxl"), ("middle_block", "sdxl"), ("output_blocks", "sdxl"), ("lora_te2", "sdxl"),
    ("unet.", "sdxl"), ("lora_unet.", "sdxl"), ("transformer.", "flux"),
    ("lora_unet_down_blocks", "sd1"), ("lora_unet_mid_block", "sd1"), ("lora_unet_up_blocks", "sd1"),
    ("lora_te_", "sd1"),
)
