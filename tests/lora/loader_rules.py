"""How ComfyUI and sd-scripts read a LoRA file, written by us from their loaders' rules, so tests can check
at full size, on the meta device, that every key of a file we write lands with the trained delta.

ComfyUI (``comfy/lora.py``, ``comfy/utils.py``, ``comfy/weight_adapter/lora.py``): a key map from LoRA module
names to the model's weights, where a diffusers FLUX name lands on a row slice of BFL's fused weight
(``flux_to_diffusers``); per module the up tensor is ``.lora_up.weight``, ``_lora.up.weight``, ``.lora_B.weight``
or ``.lora.up.weight`` (down alike), the scale is
``<module>.alpha`` / rank, or 1 when the file has no alpha key; a key no rule consumes is "lora key not
loaded". T5-XXL maps as ``lora_te3_encoder_block_…`` (and ``lora_te2_…``) onto ``t5xxl.transformer.…``.
Diffusers-named SDXL UNet attention layers map only as ``….processor.to_q`` (the old
attention-processor format). CLIP maps as ``lora_te1_text_model_…`` / ``text_encoder.text_model.…``.

sd-scripts (``networks/lora_flux.py``, ``networks/lora.py``): one LoRA per Linear/Conv named
``lora_unet_<original module path with '_'>`` (BFL names for FLUX, SGM names for SDXL), ``lora_te1_`` /
``lora_te2_`` / ``lora_te3_`` + the Hugging Face path (with ``text_model``); alpha defaults to the rank.

A :class:`Patch` is one module's contribution to one weight: its rows, up, down and scale. Deltas are
compared on a random probe vector per weight (up @ (down @ v)), which is exact enough and cheap at full size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dreamstep.models.sdxl.sgm_keys import unet_module_map

CLIP_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1",
                "mlp.fc2")
T5_MODULES = ("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
              "layer.0.SelfAttention.o", "layer.1.DenseReluDense.wi_0", "layer.1.DenseReluDense.wi_1",
              "layer.1.DenseReluDense.wo")
FLUX_DOUBLE = {"attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
               "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
               "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2"}
FLUX_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
FLUX_GLOBAL = {"proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
               "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
               "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
               "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
               "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
               "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
               "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer"}


@dataclass(frozen=True)
class Target:
    """A model weight (in the loader's own naming) and the rows of it a module adapts."""

    weight: str
    offset: int = 0
    rows: int | None = None  # None: every row


@dataclass(frozen=True)
class Patch:
    target: Target
    up: torch.Tensor
    down: torch.Tensor
    scale: float


def flux_diffusers_targets(double: int, single: int, hidden: int) -> dict[str, Target]:
    """ComfyUI's ``flux_to_diffusers``: diffusers FLUX module -> BFL weight (and rows of a fused one)."""
    out = {}
    for i in range(double):
        for fused, parts in (("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
                             ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))):
            for n, part in enumerate(parts):
                out[f"transformer_blocks.{i}.{part}"] = Target(f"double_blocks.{i}.{fused}", n * hidden, hidden)
        out |= {f"transformer_blocks.{i}.{k}": Target(f"double_blocks.{i}.{v}") for k, v in FLUX_DOUBLE.items()}
    for i in range(single):
        for n, part in enumerate(("attn.to_q", "attn.to_k", "attn.to_v")):
            out[f"single_transformer_blocks.{i}.{part}"] = Target(f"single_blocks.{i}.linear1", n * hidden, hidden)
        out[f"single_transformer_blocks.{i}.proj_mlp"] = Target(f"single_blocks.{i}.linear1", 3 * hidden, 4 * hidden)
        out |= {f"single_transformer_blocks.{i}.{k}": Target(f"single_blocks.{i}.{v}") for k, v in FLUX_SINGLE.items()}
    out |= {k: Target(v) for k, v in FLUX_GLOBAL.items()}
    return out


def _clip_keys(component: str, kohya_prefix: str, comfy_name: str, layers: int) -> dict[str, Target]:
    out = {}
    for b in range(layers):
        for c in CLIP_MODULES:
            target = Target(f"{comfy_name}.transformer.text_model.encoder.layers.{b}.{c}")
            out[f"{kohya_prefix}_text_model_encoder_layers_{b}_{c.replace('.', '_')}"] = target
            out[f"{component}.text_model.encoder.layers.{b}.{c}"] = target
    return out


def t5_keys(layers: int) -> dict[str, Target]:
    """ComfyUI's T5-XXL rule (``model_lora_keys_clip``, "OneTrainer SD3 and Flux lora"): every weight
    ``t5xxl.transformer.<path>.weight`` of a FLUX text model (CLIP-L present, no CLIP-G) maps from
    ``lora_te2_<path with _>`` and ``lora_te3_<path with _>``; here the Linears of each of ``layers`` blocks."""
    out = {}
    for b in range(layers):
        for m in T5_MODULES:
            path = f"encoder.block.{b}.{m}"
            target = Target(f"t5xxl.transformer.{path}")
            out |= {f"lora_te2_{path.replace('.', '_')}": target, f"lora_te3_{path.replace('.', '_')}": target}
    return out


def comfy_flux_key_map(double: int = 19, single: int = 38, hidden: int = 3072,
                       clip_layers: int = 12, t5_layers: int = 24) -> dict[str, Target]:
    """ComfyUI's LoRA key map for a FLUX model: diffusers ``transformer.…``, Kohya ``lora_unet_<BFL>``, CLIP-L,
    T5-XXL."""
    diffusers = flux_diffusers_targets(double, single, hidden)
    key_map = {f"transformer.{k}": t for k, t in diffusers.items()}
    key_map |= {f"lora_unet_{t.weight.replace('.', '_')}": Target(t.weight) for t in diffusers.values()}
    return key_map | _clip_keys("text_encoder", "lora_te1", "clip_l", clip_layers) | t5_keys(t5_layers)


def comfy_sdxl_key_map(unet_config: Mapping, clip_layers: int = 12, clip_g_layers: int = 32) -> dict[str, Target]:
    """ComfyUI's LoRA key map for SDXL: Kohya ``lora_unet_<SGM>`` and ``lora_unet_<diffusers>``, diffusers
    names with attention layers as ``processor.to_*``, CLIP-L and CLIP-G."""
    key_map = {}
    for ours, sgm in unet_module_map(unet_config).items():
        target = Target(sgm)
        key_map[f"lora_unet_{sgm.replace('.', '_')}"] = target
        key_map[f"lora_unet_{ours.replace('.', '_')}"] = target
        processor = ours.replace(".to_", ".processor.to_")
        key_map[f"unet.{processor.removesuffix('.0') if processor.endswith('.to_out.0') else processor}"] = target
    key_map |= _clip_keys("text_encoder", "lora_te1", "clip_l", clip_layers)
    return key_map | _clip_keys("text_encoder_2", "lora_te2", "clip_g", clip_g_layers)


def comfy_load(tensors: Mapping[str, torch.Tensor], key_map: Mapping[str, Target]) -> tuple[list[Patch], list[str]]:
    """ComfyUI's ``load_lora`` for plain LoRA: the patches, and the keys it would report as not loaded."""
    patches, loaded = [], set()
    for name, target in key_map.items():
        for up_key, down_key in ((f"{name}.lora_up.weight", f"{name}.lora_down.weight"),
                                 (f"{name}_lora.up.weight", f"{name}_lora.down.weight"),
                                 (f"{name}.lora_B.weight", f"{name}.lora_A.weight"),
                                 (f"{name}.lora.up.weight", f"{name}.lora.down.weight")):
            if up_key in tensors:
                down = tensors[down_key]
                alpha = tensors.get(f"{name}.alpha")
                scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
                patches.append(Patch(target, tensors[up_key], down, scale))
                loaded |= {up_key, down_key, f"{name}.alpha"}
                break
    return patches, sorted(k for k in tensors if k not in loaded)


def sd_scripts_load(tensors: Mapping[str, torch.Tensor], names: Mapping[str, Target]) -> tuple[list[Patch], list[str]]:
    """sd-scripts' ``create_network_from_weights`` + ``load_state_dict``: a module per ``lora_down`` key whose
    name is one of the network's (``names``); alpha defaults to the rank. Returns patches and unknown keys."""
    patches, loaded = [], set()
    for key, down in tensors.items():
        name = key.removesuffix(".lora_down.weight")
        if name == key or name not in names:
            continue
        alpha = tensors.get(f"{name}.alpha")
        scale = (float(alpha) if alpha is not None else down.shape[0]) / down.shape[0]
        patches.append(Patch(names[name], tensors[f"{name}.lora_up.weight"], down, scale))
        loaded |= {key, f"{name}.lora_up.weight", f"{name}.alpha"}
    return patches, sorted(k for k in tensors if k not in loaded)


def probe_deltas(patches: list[Patch], seed: int = 0) -> dict[str, torch.Tensor]:
    """Each adapted weight's delta applied to a fixed random input, float64, as (rows,) per row offset
    summed into one vector per weight (its length: the highest row any patch reaches)."""
    by_weight: dict[str, list[Patch]] = defaultdict(list)
    for p in patches:
        by_weight[p.target.weight].append(p)
    out = {}
    for weight, group in sorted(by_weight.items()):
        g = torch.Generator().manual_seed(seed + sum(map(ord, weight)))
        v = torch.randn(group[0].down.flatten(1).shape[1], generator=g, dtype=torch.float64)
        rows = max(p.target.offset + (p.target.rows or p.up.shape[0]) for p in group)
        total = torch.zeros(rows, dtype=torch.float64)
        for p in group:
            part = p.scale * (p.up.double().flatten(1) @ (p.down.double().flatten(1) @ v))
            total[p.target.offset:p.target.offset + part.shape[0]] += part
        out[weight] = total
    return out


def assert_same_deltas(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    """The same weights adapted, each by the same delta (fused weights may be padded with zero rows)."""
    assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))[:5]
    for weight in expected:
        a, b = got[weight], expected[weight]
        n = max(len(a), len(b))
        a, b = torch.nn.functional.pad(a, (0, n - len(a))), torch.nn.functional.pad(b, (0, n - len(b)))
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()), msg=weight)
