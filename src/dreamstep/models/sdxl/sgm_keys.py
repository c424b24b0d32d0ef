"""SDXL weights in diffusers layout <-> the original single-file (SGM / ldm) layout.

``sd_xl_base_1.0.safetensors`` holds four models under four prefixes:

==========================================  ==================================================
``model.diffusion_model.``                  UNet (``input_blocks`` / ``middle_block`` / ``output_blocks``)
``first_stage_model.``                      VAE (``encoder.down.{i}.block.{j}``, ``mid.attn_1``)
``conditioner.embedders.0.transformer.``    CLIP-L, in the transformers layout (``text_model.*``)
``conditioner.embedders.1.model.``          CLIP-G, in the OpenCLIP layout (``resblocks``, fused
                                            ``attn.in_proj_weight``, transposed ``text_projection``)
==========================================  ==================================================

The UNet map is computed from the UNet config (levels, ``layers_per_block``, which blocks have
attention), so it holds for tiny UNets as for the real one. :func:`unet_module_map` gives the
module-path map that Kohya LoRA names are built from: ``down_blocks.1.attentions.0.transformer_blocks
.0.attn1.to_q`` -> ``input_blocks.4.1.transformer_blocks.0.attn1.to_q`` (Kohya:
``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``).

:func:`sdxl_to_sgm` and :func:`sgm_to_sdxl` convert whole state dicts and raise on any key they
cannot map.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dreamstep.files import honour_umask

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
CLIP_G_PREFIX = "conditioner.embedders.1.model."

# ---------------------------------------------------------------- tables (diffusers -> SGM)

UNET_FIXED = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
VAE_FIXED = {
    "encoder.conv_in": "encoder.conv_in",
    "encoder.conv_norm_out": "encoder.norm_out",
    "encoder.conv_out": "encoder.conv_out",
    "decoder.conv_in": "decoder.conv_in",
    "decoder.conv_norm_out": "decoder.norm_out",
    "decoder.conv_out": "decoder.conv_out",
    "quant_conv": "quant_conv",
    "post_quant_conv": "post_quant_conv",
}
VAE_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2",
              "conv_shortcut": "nin_shortcut"}
# The VAE's mid-block attention uses 1x1 convolutions in ldm and linear layers in diffusers.
VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
CLIP_G_FIXED = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
    "text_projection.weight": "text_projection",
}
CLIP_G_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}
_CLIP_G_QKV = ("q_proj", "k_proj", "v_proj")
_CLIP_G_LAYER_KEY = re.compile(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class KeyMappingError(KeyError):
    """A key that the SDXL single-file mapping does not know."""


# ---------------------------------------------------------------- UNet

def _layers_per_block(unet_config: Mapping[str, Any]) -> int:
    layers = unet_config["layers_per_block"]
    if not isinstance(layers, int):
        raise TypeError(f"SGM layout needs one layers_per_block for all levels, got {layers}")
    return layers


def unet_block_map(unet_config: Mapping[str, Any]) -> dict[str, tuple[str, dict[str, str]]]:
    """diffusers block path -> (SGM block path, renames of the block's first-level children).

    SGM numbers ``input_blocks`` continuously: block 0 is ``conv_in``, then each level has
    ``layers_per_block`` (resnet[, attention]) blocks and, except the last, a downsampler block.
    ``output_blocks`` have ``layers_per_block + 1`` blocks a level, the upsampler in the last one.
    """
    per_level = _layers_per_block(unet_config)
    downs, ups = unet_config["down_block_types"], unet_config["up_block_types"]
    blocks: dict[str, tuple[str, dict[str, str]]] = {}
    for i, block_type in enumerate(downs):
        for j in range(per_level):
            n = 1 + i * (per_level + 1) + j
            blocks[f"down_blocks.{i}.resnets.{j}"] = (f"input_blocks.{n}.0", UNET_RESNET)
            if "CrossAttn" in block_type:
                blocks[f"down_blocks.{i}.attentions.{j}"] = (f"input_blocks.{n}.1", {})
        if i < len(downs) - 1:
            blocks[f"down_blocks.{i}.downsamplers.0.conv"] = (
                f"input_blocks.{(i + 1) * (per_level + 1)}.0.op", {})
    blocks["mid_block.resnets.0"] = ("middle_block.0", UNET_RESNET)
    blocks["mid_block.attentions.0"] = ("middle_block.1", {})
    blocks["mid_block.resnets.1"] = ("middle_block.2", UNET_RESNET)
    for i, block_type in enumerate(ups):
        has_attention = "CrossAttn" in block_type
        for j in range(per_level + 1):
            n = i * (per_level + 1) + j
            blocks[f"up_blocks.{i}.resnets.{j}"] = (f"output_blocks.{n}.0", UNET_RESNET)
            if has_attention:
                blocks[f"up_blocks.{i}.attentions.{j}"] = (f"output_blocks.{n}.1", {})
        if i < len(ups) - 1:
            last = i * (per_level + 1) + per_level
            blocks[f"up_blocks.{i}.upsamplers.0.conv"] = (
                f"output_blocks.{last}.{2 if has_attention else 1}.conv", {})
    blocks.update({name: (sgm, {}) for name, sgm in UNET_FIXED.items()})
    return blocks


def _rename(name: str, blocks: Mapping[str, tuple[str, Mapping[str, str]]]) -> str:
    """Rename a dotted path by its longest block prefix, then the child right below that block."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in blocks:
            target, children = blocks[prefix]
            rest = ".".join(parts[cut:])
            for child in sorted(children, key=len, reverse=True):
                if rest == child or rest.startswith(child + "."):
                    rest = children[child] + rest[len(child):]
                    break
            return f"{target}.{rest}" if rest else target
    raise KeyMappingError(f"no SGM name for '{name}'")


def _meta_unet(unet_config: Mapping[str, Any]) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel.from_config(dict(unet_config))


def unet_key_map(unet_config: Mapping[str, Any]) -> dict[str, str]:
    """Every UNet parameter: diffusers key -> SGM key (without the ``model.diffusion_model.`` prefix)."""
    blocks = unet_block_map(unet_config)
    return {key: _rename(key, blocks) for key in _meta_unet(unet_config).state_dict()}


def unet_module_map(unet_config: Mapping[str, Any]) -> dict[str, str]:
    """Every UNet module that holds parameters: diffusers module path -> SGM module path."""
    blocks = unet_block_map(unet_config)
    return {name: _rename(name, blocks) for name, module in _meta_unet(unet_config).named_modules()
            if name and any(True for _ in module.parameters(recurse=False))}


# ---------------------------------------------------------------- VAE

def vae_block_map(vae_config: Mapping[str, Any]) -> dict[str, tuple[str, dict[str, str]]]:
    """diffusers VAE block path -> (ldm block path, child renames); decoder levels run reversed."""
    levels = len(vae_config["block_out_channels"])
    per_level = vae_config["layers_per_block"]
    blocks: dict[str, tuple[str, dict[str, str]]] = {
        name: (ldm, {}) for name, ldm in VAE_FIXED.items()}
    for part in ("encoder", "decoder"):
        blocks[f"{part}.mid_block.attentions.0"] = (f"{part}.mid.attn_1", VAE_ATTENTION)
        for k in range(2):
            blocks[f"{part}.mid_block.resnets.{k}"] = (f"{part}.mid.block_{k + 1}", VAE_RESNET)
    for i in range(levels):
        for j in range(per_level):
            blocks[f"encoder.down_blocks.{i}.resnets.{j}"] = (f"encoder.down.{i}.block.{j}", VAE_RESNET)
        if i < levels - 1:
            blocks[f"encoder.down_blocks.{i}.downsamplers.0.conv"] = (f"encoder.down.{i}.downsample.conv", {})
        ldm_level = levels - 1 - i
        for j in range(per_level + 1):
            blocks[f"decoder.up_blocks.{i}.resnets.{j}"] = (f"decoder.up.{ldm_level}.block.{j}", VAE_RESNET)
        if i < levels - 1:
            blocks[f"decoder.up_blocks.{i}.upsamplers.0.conv"] = (f"decoder.up.{ldm_level}.upsample.conv", {})
    return blocks


def _is_vae_attention_weight(diffusers_key: str) -> bool:
    return ".mid_block.attentions.0." in diffusers_key and any(
        diffusers_key.endswith(f".{name}.weight") for name in ("to_q", "to_k", "to_v", "to_out.0"))


# ---------------------------------------------------------------- CLIP-G (OpenCLIP layout)

def _clip_g_to_openclip(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIPTextModelWithProjection weights -> OpenCLIP names; q/k/v fused into ``in_proj``."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if key in CLIP_G_FIXED:
            out[CLIP_G_FIXED[key]] = value.T.contiguous() if key == "text_projection.weight" else value
            continue
        match = _CLIP_G_LAYER_KEY.match(key)
        if match is None:
            raise KeyMappingError(f"no OpenCLIP name for CLIP-G key '{key}'")
        layer, module, kind = match.groups()
        if module.startswith("self_attn.") and module[len("self_attn."):] in _CLIP_G_QKV:
            qkv.setdefault((layer, kind), {})[module[len("self_attn."):]] = value
        elif module in CLIP_G_LAYER:
            out[f"transformer.resblocks.{layer}.{CLIP_G_LAYER[module]}.{kind}"] = value
        else:
            raise KeyMappingError(f"no OpenCLIP name for CLIP-G key '{key}'")
    for (layer, kind), parts in qkv.items():
        # OpenCLIP's nn.MultiheadAttention stacks q, k, v along the output dimension: (3*width, ...).
        out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat(
            [parts[name] for name in _CLIP_G_QKV], dim=0)
    return out


def _openclip_to_clip_g(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fixed = {ldm: name for name, ldm in CLIP_G_FIXED.items()}
    layer_names = {ldm: name for name, ldm in CLIP_G_LAYER.items()}
    pattern = re.compile(r"transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)$")
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in fixed:
            out[fixed[key]] = value.T.contiguous() if key == "text_projection" else value
            continue
        fused = re.fullmatch(r"transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)", key)
        match = pattern.match(key)
        if fused:
            layer, kind = fused.groups()
            for name, chunk in zip(_CLIP_G_QKV, value.chunk(3, dim=0)):
                out[f"text_model.encoder.layers.{layer}.self_attn.{name}.{kind}"] = chunk.contiguous()
        elif match and match.group(2) in layer_names:
            layer, module, kind = match.groups()
            out[f"text_model.encoder.layers.{layer}.{layer_names[module]}.{kind}"] = value
        else:
            raise KeyMappingError(f"no CLIP-G name for OpenCLIP key '{CLIP_G_PREFIX}{key}'")
    return out


# ---------------------------------------------------------------- whole checkpoints

def _with_prefix(prefix: str, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + key: value for key, value in state_dict.items()}


def _strip(prefix: str, checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key[len(prefix):]: value for key, value in checkpoint.items() if key.startswith(prefix)}


def sdxl_to_sgm(unet: Mapping[str, torch.Tensor], vae: Mapping[str, torch.Tensor],
                text_encoder: Mapping[str, torch.Tensor], text_encoder_2: Mapping[str, torch.Tensor],
                unet_config: Mapping[str, Any], vae_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The four diffusers state dicts of an SDXL pipeline -> one single-file (SGM) state dict."""
    out = _with_prefix(UNET_PREFIX, {_rename(k, unet_block_map(unet_config)): v for k, v in unet.items()})
    out.update(_with_prefix(VAE_PREFIX, vae_to_ldm(vae, vae_config)))
    # transformers >= 5.6 saves CLIPTextModel without the "text_model." level; SGM keeps it.
    out.update(_with_prefix(CLIP_L_PREFIX + "text_model.",
                            {k.removeprefix("text_model."): v for k, v in text_encoder.items()}))
    out.update(_with_prefix(CLIP_G_PREFIX, _clip_g_to_openclip(text_encoder_2)))
    return out


def vae_to_ldm(vae: Mapping[str, torch.Tensor], vae_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A diffusers VAE's state dict in the LDM layout (SDXL's first stage; FLUX.1's ae.safetensors)."""
    blocks = vae_block_map(vae_config)
    # An attention projection is a (C, C) linear in diffusers and a (C, C, 1, 1) conv in LDM.
    return {_rename(key, blocks): value[:, :, None, None] if _is_vae_attention_weight(key) else value
            for key, value in vae.items()}


def sgm_to_sdxl(checkpoint: Mapping[str, torch.Tensor], unet_config: Mapping[str, Any],
                vae_config: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """A single-file (SGM) state dict -> diffusers state dicts keyed ``unet``, ``vae``,
    ``text_encoder`` (flat keys, as transformers >= 5.6 saves it) and ``text_encoder_2``."""
    known = (UNET_PREFIX, VAE_PREFIX, CLIP_L_PREFIX, CLIP_G_PREFIX)
    stray = [key for key in checkpoint if not key.startswith(known)]
    if stray:
        raise KeyMappingError(f"{len(stray)} keys outside the SDXL prefixes, e.g. '{stray[0]}'")
    unet_names = {sgm: name for name, sgm in unet_key_map(unet_config).items()}
    unet = {}
    for key, value in _strip(UNET_PREFIX, checkpoint).items():
        if key not in unet_names:
            raise KeyMappingError(f"no diffusers name for '{UNET_PREFIX}{key}'")
        unet[unet_names[key]] = value
    return {
        "unet": unet,
        "vae": _vae_from_ldm(_strip(VAE_PREFIX, checkpoint), vae_config),
        "text_encoder": _strip(CLIP_L_PREFIX + "text_model.", checkpoint),
        "text_encoder_2": _openclip_to_clip_g(_strip(CLIP_G_PREFIX, checkpoint)),
    }


def _vae_from_ldm(state_dict: Mapping[str, torch.Tensor],
                  vae_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    blocks = vae_block_map(vae_config)
    names = {}
    for block, (ldm_block, children) in blocks.items():
        for child, ldm_child in (children or {"": ""}).items():
            for kind in ("weight", "bias"):
                name = ".".join(p for p in (block, child, kind) if p)
                names[".".join(p for p in (ldm_block, ldm_child, kind) if p)] = name
    out = {}
    for key, value in state_dict.items():
        if key not in names:
            raise KeyMappingError(f"no diffusers name for '{VAE_PREFIX}{key}'")
        name = names[key]
        out[name] = value[:, :, 0, 0] if _is_vae_attention_weight(name) else value
    return out


def save_sdxl_single_file(pipe: Any, path: str | Path) -> Path:
    """Write an SDXL pipeline's UNet, VAE and both text encoders as one SGM-layout .safetensors."""
    checkpoint = sdxl_to_sgm(pipe.unet.state_dict(), pipe.vae.state_dict(),
                             pipe.text_encoder.state_dict(), pipe.text_encoder_2.state_dict(),
                             pipe.unet.config, pipe.vae.config)
    path = Path(path)
    save_file({k: v.contiguous() for k, v in checkpoint.items()}, str(path),
              metadata={"format": "pt", "modelspec.architecture": "stable-diffusion-xl-v1-base"})
    honour_umask(path)
    return path

