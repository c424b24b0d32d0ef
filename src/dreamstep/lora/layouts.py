"""LoRA layouts: which of Kohya, diffusers/PEFT and MindSpore a state dict is in, which model it is for,
and its modules as :class:`LoraWeights` (down, up, alpha) read from a file and written back as a state
dict of any layout, with alphas folded into ``up`` where a target cannot hold them."""

from __future__ import annotations

import collections
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dreamstep.config.choices import LORA_LAYOUTS
from dreamstep.errors import UserError
from dreamstep.lora import formats
from dreamstep.lora.io import LoraFile, adapter_metadata
from dreamstep.models.full_size import with_text_model

LAYOUTS = LORA_LAYOUTS


@dataclass(frozen=True)
class LoraWeights:
    """One adapted module: ``down`` (rank, in[, kh, kw]) = PEFT lora_A, ``up`` (out, rank[, 1, 1]) = lora_B."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# ------------------------------------------------------------------------------------- layouts and models


def _layout_of_key(key: str) -> str | None:
    key = formats.peft_key(key)
    if re.match(r"lora_(unet|te\d?)_\w+\.(lora_down\.weight|lora_up\.weight|alpha)$", key):
        return "kohya"
    if re.match(r"lora_(unet|te\d)\.\S+\.(lora_down\.weight|lora_up\.weight|alpha)$", key):
        return "mindspore"
    if re.match(r"[a-z_0-9]+\.\S+\.(lora_A\.weight|lora_B\.weight|alpha)$", key):
        return "diffusers"
    return None


def detect_layout(keys: list[str], source: str) -> str:
    """'kohya', 'diffusers' or 'mindspore'; a key in none of them, or a mix, is a UserError naming it."""
    if not keys:
        raise UserError(f"{source}: the file holds no tensors")
    layouts = {}
    for key in keys:
        layout = _layout_of_key(key)
        if layout is None:
            raise UserError(f"{source}: key '{key}' is not a LoRA key in any layout dreamstep reads (Kohya "
                            f"'lora_unet_….lora_down.weight', diffusers '<component>.….lora_A.weight', "
                            f"MindSpore 'lora_unet.….lora_down.weight', or a LyCORIS file)")
        layouts.setdefault(layout, key)
    if len(layouts) > 1:
        (a, ka), (b, kb) = list(layouts.items())[:2]
        raise UserError(f"{source}: mixes LoRA layouts: '{ka}' is {a}, '{kb}' is {b}")
    return next(iter(layouts))




# ------------------------------------------------------------------------------ state dict <-> modules


def _alpha_from_adapter(cfg: Mapping, module: str, rank: int) -> float:
    """PEFT's effective alpha for ``module``: alpha_pattern over lora_alpha; rsLoRA's alpha/sqrt(r) scale
    expressed as the alpha that gives the same scale with alpha/r."""
    pattern = cfg.get("alpha_pattern") or {}
    if pattern:
        from peft.utils.other import get_pattern_key  # peft takes seconds to import; most files have no pattern

        alpha = float(pattern.get(get_pattern_key(list(pattern), module), cfg.get("lora_alpha", rank)))
    else:
        alpha = float(cfg.get("lora_alpha", rank))
    return alpha * math.sqrt(rank) if cfg.get("use_rslora") else alpha


_FLAT_CLIP_NAMES = {
    "kohya": (re.compile(r"^(lora_te\d)_encoder_layers_"), r"\1_text_model_encoder_layers_"),
    "mindspore": (re.compile(r"^(lora_te\d)\.encoder\.layers\."), r"\1.text_model.encoder.layers."),
}


def canonical_name(name: str, layout: str) -> str:
    """A module name with CLIP's ``text_model`` level, which transformers 5 dropped from CLIPTextModel: files
    written under either version name the same module the same way from here on."""
    if layout == "diffusers":
        return with_text_model(name)
    pattern, replacement = _FLAT_CLIP_NAMES[layout]
    return pattern.sub(replacement, name)


def modules_from_file(lora: LoraFile, layout: str) -> dict[str, LoraWeights]:
    """Group a file's tensors into modules named in its layout (Kohya/MindSpore names keep their prefix,
    diffusers names keep their component; CLIP names always with ``text_model``, see
    :func:`canonical_name`). A module's alpha defaults to its rank (scale 1)."""
    source = str(lora.path)
    down_s, up_s = formats.DIFFUSERS_SUFFIXES if layout == "diffusers" else formats.KOHYA_SUFFIXES
    parts: dict[str, dict[str, torch.Tensor]] = collections.defaultdict(dict)
    for key, tensor in lora.tensors.items():
        key = formats.peft_key(key) if layout == "diffusers" else key
        for role, suffix in (("down", down_s), ("up", up_s), ("alpha", formats.ALPHA_SUFFIX)):
            if key.endswith(suffix):
                parts[key[: -len(suffix)]][role] = tensor
    adapters = adapter_metadata(lora) if layout == "diffusers" else None
    if adapters and any(k.endswith(".use_dora") and v for k, v in adapters.items()):
        raise UserError(f"{source}: a DoRA adapter (use_dora in its header); dreamstep converts plain LoRA only")
    modules = {}
    for name, p in parts.items():
        if "down" not in p or "up" not in p:
            missing = down_s if "down" not in p else up_s
            raise UserError(f"{source}: module '{name}' has no '{name}{missing}' tensor")
        rank = p["down"].shape[0]
        if p["up"].shape[1] != rank:
            raise UserError(f"{source}: module '{name}' has rank {rank} in down but {p['up'].shape[1]} in up")
        if "alpha" in p:
            alpha = float(p["alpha"].item())
        elif adapters:
            component, _, module = name.partition(".")
            cfg = {k.removeprefix(f"{component}."): v for k, v in adapters.items() if k.startswith(f"{component}.")}
            alpha = _alpha_from_adapter(cfg, module, rank)
        else:
            alpha = float(rank)
        modules[canonical_name(name, layout)] = LoraWeights(p["down"], p["up"], alpha)
    return modules


def _alpha_tensor(alpha: float) -> torch.Tensor:
    """alpha as a scalar tensor: float32 as sd-scripts stores it, float64 when float32 would round it."""
    as32 = torch.tensor(alpha, dtype=torch.float32)
    return as32 if float(as32) == alpha else torch.tensor(alpha, dtype=torch.float64)


def kohya_state_dict(modules: Mapping[str, LoraWeights]) -> dict[str, torch.Tensor]:
    """Kohya (or MindSpore) tensors: ``<name>.lora_down.weight``, ``.lora_up.weight``, ``.alpha``."""
    down_s, up_s = formats.KOHYA_SUFFIXES
    out = {}
    for name, m in modules.items():
        out |= {name + down_s: m.down, name + up_s: m.up, name + formats.ALPHA_SUFFIX: _alpha_tensor(m.alpha)}
    return out


def diffusers_state_dict(modules: Mapping[str, LoraWeights]) -> dict[str, torch.Tensor]:
    """diffusers/PEFT tensors ``<component>.<module>.lora_A.weight`` / ``.lora_B.weight``; no alphas."""
    down_s, up_s = formats.DIFFUSERS_SUFFIXES
    out = {}
    for name, m in modules.items():
        out |= {name + down_s: m.down, name + up_s: m.up}
    return out


def diffusers_file_contents(modules: Mapping[str, LoraWeights],
                            container: str = "safetensors") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and header of a diffusers-layout file that diffusers, ComfyUI and our reader all apply at the
    trained alpha / rank. ComfyUI reads alpha only from ``<module>.alpha`` keys, else scale 1; diffusers'
    SDXL loader refuses such keys in this layout, its FLUX loader refuses them beside an adapter-config
    header and, without the header, applies per-module ranks and alphas by unanchored name patterns
    ('proj_out' also catches 'single_transformer_blocks.0.proj_out'). So each module's alpha / rank is
    folded into lora_B (alpha = rank, scale 1 for every loader) and the header gives anchored rank
    patterns. CLIP modules are named ``text_encoder.text_model.…`` (see :func:`canonical_name`), the only
    form ComfyUI maps; diffusers drops 'text_model.' where transformers 5 has no such level. An SDXL UNet
    takes diffusers' older names (:func:`~dreamstep.lora.formats.legacy_unet_key`), the only ones under
    which ComfyUI maps its attention layers."""
    folded = fold_alpha(modules)
    tensors = {formats.legacy_unet_key(k): v for k, v in diffusers_state_dict(folded).items()}
    return tensors, diffusers_adapter_metadata(folded) if container == "safetensors" else {}


def _peft_pattern(module: str) -> str:
    """A PEFT name pattern matching exactly ``module``. Patterns are regexes matched against module-path
    suffixes; '^' anchors them (diffusers' own convention), so 'proj_out' cannot also catch
    'single_transformer_blocks.0.proj_out'. transformers >= 5 flattened CLIPTextModel (no 'text_model.'),
    so that prefix is optional and the file loads under old and new transformers alike."""
    if module.startswith("text_model."):
        return r"^(text_model\.)?" + re.escape(module.removeprefix("text_model."))
    return "^" + re.escape(module)


def diffusers_adapter_metadata(modules: Mapping[str, LoraWeights]) -> dict[str, str]:
    """The ``lora_adapter_metadata`` header diffusers' ``save_lora_weights`` writes: per component a PEFT
    LoraConfig, flattened as ``<component>.<field>``, with the most common rank and alpha as ``r`` and
    ``lora_alpha``, every other module's in ``rank_pattern`` / ``alpha_pattern``, and ``target_modules`` one
    regex that matches the adapted modules and nothing else."""
    by_component: dict[str, dict[str, LoraWeights]] = collections.defaultdict(dict)
    for name, m in modules.items():
        component, _, module = name.partition(".")
        by_component[component][module] = m
    flat = {}
    for component, mods in sorted(by_component.items()):
        r = collections.Counter(m.rank for m in mods.values()).most_common(1)[0][0]
        alpha = collections.Counter(m.alpha for m in mods.values()).most_common(1)[0][0]
        config = {
            "r": r,
            "lora_alpha": alpha,
            "rank_pattern": {_peft_pattern(k): m.rank for k, m in mods.items() if m.rank != r},
            "alpha_pattern": {_peft_pattern(k): m.alpha for k, m in mods.items() if m.alpha != alpha},
            "target_modules": "|".join(_peft_pattern(k)[1:] for k in sorted(mods)),
        }
        flat |= {f"{component}.{k}": v for k, v in config.items()}
    return {formats.ADAPTER_METADATA_KEY: json.dumps(flat, indent=2, sort_keys=True)}


def fold_alpha(modules: Mapping[str, LoraWeights]) -> dict[str, LoraWeights]:
    """Every module with alpha == rank (scale 1), its scale multiplied into ``up``: for loaders that read
    no alpha (diffusers given an in-memory dict or a torch file). Exact when the scale is a power of two."""
    out = {}
    for name, m in modules.items():
        up = m.up if m.alpha == m.rank else (m.up.float() * m.scale).to(m.up.dtype)
        out[name] = LoraWeights(m.down, up, float(m.rank))
    return out
