"""``--network_weights``: continue from a saved adapter file instead of the fresh init (``train flux-lora``; any
family whose trainer builds its LoRA from :meth:`~dreamstep.models.family.ModelFamily.lora_targets`).

As sd-scripts' ``--network_weights``: the file's weights are loaded and its alpha is the one trained with. A
LyCORIS file's alpha must equal a given ``--lora_alpha``; a plain LoRA's ``up`` is rescaled to a given
``--lora_alpha`` (flux-lora's diffusers file stores alpha folded, as alpha = rank), so its delta is the file's.
The file must be what the flags build: the same type (``--lora_type``), rank and layers. What its header tells
(type, model, rank, text encoder, alpha) is checked before any model loads; which layers it adapts, and each
tensor's shape, against the built adapters (nothing is written yet).

A plain LoRA is read in either layout flux-lora writes (diffusers, or sd-scripts' names from
``--save_kohya_format``) through the conversion code; a LoKr/LoHa/DoRA file through the LyCORIS network's own
loader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dreamstep.errors import UserError
from dreamstep.lora.convert import read_lora, to_diffusers
from dreamstep.lora.formats import DIFFUSERS_SUFFIXES, model_keys
from dreamstep.lora.io import read_lora_file, sniff_container
from dreamstep.lora.layouts import LoraWeights, canonical_name
from dreamstep.lora.lycoris_network import FLUX_PREFIX, LycorisNetwork, create_flux_network, is_lycoris
from dreamstep.models.family import ModelFamily, guess_family, model_title

FLAG = "--network_weights"
_TYPE_NAMES = {"lora": "plain LoRA", "lokr": "LoKr", "loha": "LoHa", "dora": "DoRA",
               "lycoris-lora": "LyCORIS LoRA (no DoRA)"}
_TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder.")


@dataclass(frozen=True)
class StartingFile:
    """A checked ``--network_weights`` file: its path, the alpha to train with, and (plain LoRA) its modules
    under diffusers names."""

    path: Path
    alpha: float | None
    modules: dict[str, LoraWeights] | None = None


def _header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, float]]:
    """Each tensor's shape, and the alpha scalars' values, reading no other tensor of a .safetensors file."""
    if not path.is_file():
        raise UserError(f"{FLAG} {path}: no such file; give the adapter file a run wrote "
                        "(pytorch_lora_weights.safetensors)")
    if sniff_container(path) != "safetensors":
        tensors = read_lora_file(path).tensors
        return ({k: tuple(v.shape) for k, v in tensors.items()},
                {k: float(v) for k, v in tensors.items() if k.endswith(".alpha")})
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (a file)
            alphas = {key: float(f.get_tensor(key)) for key in shapes if key.endswith(".alpha")}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{FLAG} {path}: not a readable safetensors file (truncated or corrupt: {e})") from None
    return shapes, alphas


def _file_type(keys: list[str]) -> str:
    if not is_lycoris(keys):
        return "lora"
    for suffix, kind in ((".lokr_w", "lokr"), (".hada_w", "loha"), (".dora_scale", "dora")):
        if any(suffix in key for key in keys):
            return kind
    return "lycoris-lora"


def _lycoris_rank(shapes: Mapping[str, tuple[int, ...]], kind: str) -> set[int]:
    """The ranks a LyCORIS file's tensors show (LoKr: of its low-rank factors; none in full-matrix mode)."""
    suffix = {"loha": ".hada_w1_b", "lokr": ".lokr_w2_b", "dora": ".lora_down.weight"}[kind]
    return {shape[0] for key, shape in shapes.items() if key.endswith(suffix)}


def _one(values: set, what: str, path: Path) -> Any:
    if len(values) > 1:
        raise UserError(f"{FLAG} {path}: its modules have different {what}s ({', '.join(map(str, sorted(values)))}); "
                        f"the run trains one {what} for all")
    return next(iter(values), None)


def _check_rank(ranks: set[int], config: Any, path: Path) -> None:
    rank = _one(ranks, "rank", path)
    if rank is not None and rank != config.rank:
        raise UserError(f"{FLAG} {path}: the file has rank {rank}, --rank is {config.rank}; use --rank {rank}")


def _check_alpha(alpha: float | None, config: Any, path: Path) -> float | None:
    """The file's alpha, which the run takes; a different --lora_alpha is refused."""
    if alpha is not None and config.lora_alpha is not None and float(config.lora_alpha) != alpha:
        raise UserError(f"{FLAG} {path}: the file's alpha is {alpha:g}, --lora_alpha is {config.lora_alpha:g}; "
                        f"drop --lora_alpha (the file's is used) or give --lora_alpha {alpha:g}")
    return alpha


def check_starting_file(config: Any, family: ModelFamily, denoiser: nn.Module) -> StartingFile:
    """Check ``config.network_weights`` against the flags before any model loads (see the module docstring);
    ``denoiser``: the run's denoiser built on the meta device (no weights), which the adapters target."""
    path = Path(config.network_weights)
    shapes, alphas = _header(path)
    keys = list(shapes)
    if not keys:
        raise UserError(f"{FLAG} {path}: the file holds no tensors")
    names = sorted({key.split(".", 1)[0] if key.startswith(("lora_", FLUX_PREFIX)) else key for key in keys})
    model, evidence = guess_family(names)
    if model not in (family.name, None):
        raise UserError(f"{FLAG} {path}: an adapter for {model_title(model)} ('{evidence}'); continue from a "
                        f"{family.title} file")
    kind = _file_type(keys)
    if kind != config.lora_type:
        hint = f"--lora_type {kind}" if kind in _TYPE_NAMES and kind != "lycoris-lora" else "another file"
        raise UserError(f"{FLAG} {path}: a {_TYPE_NAMES[kind]} file, --lora_type is {config.lora_type}; "
                        f"use {hint}")
    text_encoder = any(key.startswith(_TEXT_ENCODER_PREFIXES) for key in keys)
    if text_encoder != config.train_text_encoder:
        raise UserError(f"{FLAG} {path}: the file " + ("adapts the CLIP text encoder; add --train_text_encoder"
                                                        if text_encoder else
                                                        "has no text-encoder adapters; drop --train_text_encoder"))
    if kind != "lora":
        full_matrix = any(key.endswith(".lokr_w2") for key in keys)
        if kind == "lokr" and full_matrix != config.lokr_full_matrix:
            raise UserError(f"{FLAG} {path}: the file's LoKr is {'' if full_matrix else 'not '}in full-matrix mode; "
                            f"{'give' if not full_matrix else 'drop'} --lokr_full_matrix false")
        decomposed = any(key.endswith(".lokr_w1_a") for key in keys)
        if kind == "lokr" and decomposed != config.lokr_decompose_both:
            raise UserError(f"{FLAG} {path}: the file's LoKr {'decomposes' if decomposed else 'does not decompose'} "
                            f"both factors; {'give' if decomposed else 'drop'} --lokr_decompose_both")
        alpha = None
        if not (kind == "lokr" and full_matrix):  # a full-matrix LoKr has no rank, and LyCORIS sets its alpha
            _check_rank(_lycoris_rank(shapes, kind), config, path)
            alpha = _check_alpha(_one(set(alphas.values()), "alpha", path), config, path)
        _check_lycoris_transformer(shapes, config, family, denoiser, path)
        return StartingFile(path, alpha)
    try:
        lora = read_lora(path, family.name)
        modules = to_diffusers(lora, model_keys(family.name, {family.denoiser: dict(denoiser.config)}))
    except UserError as e:
        raise UserError(f"{FLAG} {e}") from None
    if any(name.startswith("text_encoder_2.") for name in modules):
        raise UserError(f"{FLAG} {path}: the file adapts the T5 text encoder, which flux-lora does not train")
    _check_rank({m.rank for m in modules.values()}, config, path)
    # flux-lora's diffusers file holds alpha folded into up (alpha = rank); a given --lora_alpha is kept and each
    # module's up rescaled to it on loading, so the adapter's delta is the file's either way.
    alphas = {m.alpha for m in modules.values()}
    alpha = config.lora_alpha if config.lora_alpha is not None else _one(alphas, "alpha", path)
    _check_lora_transformer(modules, config, family, denoiser, path)
    return StartingFile(path, float(alpha), modules)


def _check_lora_transformer(modules: Mapping[str, LoraWeights], config: Any, family: ModelFamily,
                            denoiser: nn.Module, path: Path) -> None:
    """The file's denoiser modules are those --lora_layers adapts, each with the layer's width."""
    prefix = f"{family.denoiser}."
    targets = {prefix + t: denoiser.get_submodule(t) for t in family.lora_targets(denoiser, config.lora_layers)}
    _differences({name for name in modules if name.startswith(prefix)}, set(targets), path, "adapter")
    for name, layer in targets.items():
        down, up = modules[name].down, modules[name].up
        if (down.shape[1], up.shape[0]) != (layer.in_features, layer.out_features):
            raise UserError(f"{FLAG} {path}: '{name}' is {up.shape[0]}x{down.shape[1]} in the file, "
                            f"{layer.out_features}x{layer.in_features} in this model; the file was made for "
                            "another model size")


def _check_lycoris_transformer(shapes: Mapping[str, tuple[int, ...]], config: Any, family: ModelFamily,
                               denoiser: nn.Module, path: Path) -> None:
    """The file's transformer tensors are those the configured LyCORIS network has, by name and shape (the
    network built on the meta device; DoRA's magnitude, which LyCORIS computes from real weights, is left to
    the loading)."""
    options = dataclasses.replace(config.lycoris_options(), dora_wd=False)
    network = create_flux_network(denoiser, family.lora_targets(denoiser, config.lora_layers), None, (), options)
    own = {key: tuple(value.shape) for key, value in network.state_dict().items()}
    found = {key: shape for key, shape in shapes.items() if key.startswith(FLUX_PREFIX)}
    _differences({key.split(".", 1)[0] for key in found}, {key.split(".", 1)[0] for key in own}, path, "module")
    for key, shape in found.items():
        if key.endswith(".dora_scale"):
            continue
        if key not in own:
            raise UserError(f"{FLAG} {path}: tensor '{key}' does not belong to this network; train with the "
                            "file's --lora_type, --rank, --lokr_factor and options")
        if shape != own[key]:
            raise UserError(f"{FLAG} {path}: '{key}' has shape {shape}, the network needs {own[key]}; "
                            "use the file's --rank, --lokr_factor and options")


def _differences(found: set[str], built: set[str], path: Path, what: str) -> None:
    missing, extra = sorted(built - found), sorted(found - built)
    if missing:
        raise UserError(f"{FLAG} {path}: the file has no {what} for '{missing[0]}' ({len(missing)} in all) that "
                        "--lora_layers / --train_text_encoder adapt; use the file's --lora_layers")
    if extra:
        raise UserError(f"{FLAG} {path}: the file adapts '{extra[0]}' ({len(extra)} in all), which --lora_layers "
                        "does not; use the file's --lora_layers")


@torch.no_grad()
def load_into_lora(start: StartingFile, models: Mapping[str, nn.Module | None]) -> None:
    """Put a plain LoRA file's weights into the peft LoRA of ``models`` ({"transformer": ..., "text_encoder":
    ...}); the file must adapt exactly the modules they adapt, with their shapes."""
    from peft.utils import get_peft_model_state_dict

    from dreamstep.lora.inject import load_trainable_state

    down_s, up_s = DIFFUSERS_SUFFIXES
    own = {}  # diffusers name -> (component, peft module path)
    for component, model in models.items():
        if model is None:
            continue
        for key in get_peft_model_state_dict(model):
            if key.endswith(down_s):
                module = key.removesuffix(down_s)
                own[canonical_name(f"{component}.{module}", "diffusers")] = (component, module)
    _differences(set(start.modules), set(own), start.path, "adapter")
    states: dict[str, dict[str, torch.Tensor]] = {component: {} for component in models}
    for name, weights in start.modules.items():
        component, module = own[name]
        target = models[component].get_submodule(module)
        need = (target.lora_A["default"].weight.shape, target.lora_B["default"].weight.shape)
        if (weights.down.shape, weights.up.shape) != need:
            raise UserError(f"{FLAG} {start.path}: '{name}' has down {tuple(weights.down.shape)} and up "
                            f"{tuple(weights.up.shape)}, the model needs {tuple(need[0])} and {tuple(need[1])}; "
                            "the file was made for another model size")
        states[component][module + down_s] = weights.down.float()
        states[component][module + up_s] = weights.up.float() * (weights.alpha / start.alpha)
    for component, state in states.items():
        if models.get(component) is not None:
            load_trainable_state(models[component], state)


def load_into_network(start: StartingFile, network: LycorisNetwork) -> None:
    """Put a LyCORIS file's weights into ``network``: every module it builds must be in the file, and every
    tensor of the file must fit (:meth:`LycorisNetwork.load_weights`)."""
    found = {key.split(".", 1)[0] for key in _header(start.path)[0]}
    _differences(found, set(network.loras), start.path, "module")
    network.load_weights(start.path, FLAG)
