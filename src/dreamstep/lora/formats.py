"""LoRA key layouts as data: which module of one layout is which module of another.

Three layouts name the same LoRA differently:

* **kohya** (sd-scripts): ``<prefix>_<module path with '.' -> '_'>.lora_down.weight`` / ``.lora_up.weight`` /
  ``.alpha``. FLUX modules are the BFL (original) ones, where q, k, v (and the single blocks' MLP input) are
  one fused Linear; SDXL UNet modules use the SGM names (``input_blocks.4.1...``).
* **diffusers** (PEFT): ``<component>.<diffusers module>.lora_A.weight`` / ``.lora_B.weight``; alpha lives in
  the ``lora_adapter_metadata`` safetensors header (a PEFT ``LoraConfig`` per component) or is folded in.
  An SDXL UNet may come in diffusers' older attention-processor names (see :func:`legacy_unet_key`).
* **mindspore** (the mindone port, SDXL): ``<kohya prefix>.<diffusers module>.lora_down.weight`` / ... .

The facts come first; :func:`model_keys` then expands them into the tables of one concrete model (its block
and layer counts), which :mod:`dreamstep.lora.convert` maps through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Final

from dreamstep.errors import UserError
from dreamstep.models.published_configs import SDXL_UNET
from dreamstep.models.sgm_keys import unet_module_map

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

# Names that give away which model a file was made for, per layout (checked in this order).
MODEL_HINTS: Final[tuple[tuple[str, str], ...]] = (
    ("double_blocks", "flux"), ("single_blocks", "flux"), ("lora_te3", "flux"),
    ("single_transformer_blocks", "flux"), ("transformer.transformer_blocks", "flux"),
    ("input_blocks", "sdxl"), ("middle_block", "sdxl"), ("output_blocks", "sdxl"), ("lora_te2", "sdxl"),
    ("unet.", "sdxl"), ("lora_unet.", "sdxl"), ("transformer.", "flux"),
    ("lora_unet_down_blocks", "sd1"), ("lora_unet_mid_block", "sd1"), ("lora_unet_up_blocks", "sd1"),
    ("lora_te_", "sd1"),
)


# ------------------------------------------- the tables expanded for one concrete model


@dataclass(frozen=True)
class ModuleMap:
    """One Kohya module and the diffusers module(s) it is; ``rows`` gives fused parts' output rows in units
    of the module's input width."""

    kohya: str
    diffusers: tuple[str, ...]
    rows: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class ModelKeys:
    """Every module a LoRA may adapt in one concrete model, in the Kohya and diffusers namings."""

    model: str
    description: str
    maps: tuple[ModuleMap, ...]

    @cached_property
    def by_kohya(self) -> dict[str, ModuleMap]:
        return {m.kohya: m for m in self.maps}

    @cached_property
    def by_diffusers(self) -> dict[str, ModuleMap]:
        return {name: m for m in self.maps for name in m.diffusers}


def _underscored(prefix: str, module: str) -> str:
    """sd-scripts' name of a module: its dotted path with underscores, after ``prefix``."""
    return f"{prefix}_{module.replace('.', '_')}"


def _text_encoder_maps(prefix: str, component: str, templates: tuple[str, ...], layers: int) -> list[ModuleMap]:
    return [ModuleMap(_underscored(prefix, t.format(i=i)), (f"{component}.{t.format(i=i)}",))
            for i in range(layers) for t in templates]


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
                maps.append(ModuleMap(_underscored("lora_unet", f"{kind}.{i}.{bfl}"),
                                      tuple(f"transformer.{ours}.{i}.{p}" for p in parts),
                                      FLUX_FUSED_ROWS.get(bfl, (1,))))
    globals_ = {**FLUX_GLOBAL, **(FLUX_GUIDANCE if cfg["guidance_embeds"] else {})}
    maps += [ModuleMap(_underscored("lora_unet", bfl), (f"transformer.{ours}",)) for bfl, ours in globals_.items()]
    maps += _text_encoder_maps("lora_te1", "text_encoder", CLIP_LAYER, clip_layers)
    maps += _text_encoder_maps("lora_te3", "text_encoder_2", T5_LAYER, t5_layers)
    desc = f"FLUX.1 transformer with {cfg['num_layers']} double and {cfg['num_single_layers']} single blocks"
    return ModelKeys("flux", desc, tuple(maps))


def sdxl_keys(unet: Mapping | None = None, clip_layers: int = SDXL_CLIP_LAYERS["text_encoder"],
              clip_g_layers: int = SDXL_CLIP_LAYERS["text_encoder_2"]) -> ModelKeys:
    """The SDXL tables for a UNet config (default: stable-diffusion-xl-base-1.0)."""
    cfg = dict(unet or SDXL_UNET)
    maps = [ModuleMap(_underscored("lora_unet", sgm), (f"unet.{ours}",))
            for ours, sgm in unet_module_map(cfg).items()]
    maps += _text_encoder_maps("lora_te1", "text_encoder", CLIP_LAYER, clip_layers)
    maps += _text_encoder_maps("lora_te2", "text_encoder_2", CLIP_LAYER, clip_g_layers)
    desc = f"SDXL UNet with block widths {tuple(cfg['block_out_channels'])}"
    return ModelKeys("sdxl", desc, tuple(maps))


def model_keys(model: str, configs: Mapping[str, Mapping] | None = None) -> ModelKeys:
    """Tables for ``model`` ('flux' or 'sdxl') from component configs (see :func:`folder_configs`);
    without configs, for the released model."""
    main = {"flux": "transformer", "sdxl": "unet"}.get(model)
    if main is None:
        raise UserError(f"unknown model '{model}'; use flux or sdxl")
    if configs and main not in configs:
        raise UserError(f"the base model has no {main}/config.json, so it is not a {MODEL_NAMES[model]} pipeline")
    configs = configs or {}
    te = configs.get("text_encoder", {}).get("num_hidden_layers")
    te2 = configs.get("text_encoder_2", {})
    if model == "flux":
        return flux_keys(configs.get("transformer"), te or FLUX_DEFAULTS["clip_layers"],
                         te2.get("num_layers", FLUX_DEFAULTS["t5_layers"]))
    return sdxl_keys(configs.get("unet"), te or SDXL_CLIP_LAYERS["text_encoder"],
                     te2.get("num_hidden_layers", SDXL_CLIP_LAYERS["text_encoder_2"]))


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
