"""LoRA conversion between the Kohya, diffusers/PEFT and MindSpore layouts, for FLUX.1 and SDXL.

A LoRA is read into :class:`~dreamstep.lora.layouts.LoraWeights` (down, up, alpha) named in its own
layout, moved to the diffusers names (the hub every conversion passes through) and from there to the target
layout. The module tables come from :mod:`dreamstep.lora.formats` expanded for one concrete model
(:class:`ModelKeys`), so a module the target model does not have is an error that names it, never a
silent drop.

Exactness: the merged weight ``W + alpha / rank * up @ down`` of every module is kept. Kohya's fused FLUX
modules (``img_attn.qkv``, ``single_blocks.N.linear1``) split into diffusers' q, k, v (, mlp) by rows of
``up``; separate diffusers modules fuse into one Kohya module by stacking ``down`` along the rank axis with a
block-diagonal ``up``. When the parts' scales (alpha / rank) differ, no single alpha can express them, so the
scales are folded into ``up`` and the fused alpha equals its rank; that is reported as a note.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dreamstep.errors import UserError, did_you_mean
from dreamstep.lora import formats
from dreamstep.lora.formats import model_keys
from dreamstep.lora.io import container_for, read_lora_file, write_lora_file
from dreamstep.lora.layouts import (
    LAYOUTS,
    LoraWeights,
    detect_layout,
    diffusers_file_contents,
    diffusers_state_dict,
    fold_alpha,
    kohya_state_dict,
    modules_from_file,
)
from dreamstep.lora.lycoris_files import LycorisFile, dora_as_diffusers, lycoris_readers, read_lycoris
from dreamstep.lora.lycoris_network import is_lycoris
from dreamstep.models.family import families, get_family, guess_family, model_title
from dreamstep.models.full_size import lora_shape_problem, weight_shapes
from dreamstep.models.lora_keys import ModelKeys
from dreamstep.models.precision import dtype_named

# --------------------------------------------------------------------------- one function per direction


def _exact_alpha(scale: float, rank: int) -> float | None:
    """An alpha (float32-representable) with alpha / rank == scale exactly, or None when there is none."""
    alpha = float(torch.tensor(scale * rank, dtype=torch.float32))
    return alpha if alpha / rank == scale else None


def _unmapped(name: str, keys: ModelKeys, source: str) -> UserError:
    model, _ = guess_family([name])
    if model is not None and model != keys.model:
        return UserError(f"{source}: module '{name}' has no counterpart in {model_title(keys.model)}; "
                         f"this LoRA looks made for {model_title(model)}")
    return UserError(f"{source}: module '{name}' does not exist in the target {keys.description}; "
                     f"the LoRA was made for another model or model size (give the right --model / --base)")


def _used_columns(up: torch.Tensor) -> tuple[int, int] | None:
    """The span [first, last + 1) of rank columns where ``up`` is non-zero, or None when it is all zero."""
    used = up.reshape(up.shape[0], up.shape[1], -1).abs().sum(dim=(0, 2)).nonzero().flatten()
    return (int(used[0]), int(used[-1]) + 1) if len(used) else None


def _split(fused: LoraWeights, rows: tuple[int, ...], name: str, source: str) -> list[LoraWeights | None]:
    """A fused Kohya module as its parts. Each part's up is its rows of the fused up; when the fused up is
    block-diagonal (it came from separate modules), each part keeps only its own columns and down rows,
    and a part whose rows are all zero is dropped (None)."""
    sizes = [r * fused.down.shape[1] for r in rows]
    if fused.up.shape[0] != sum(sizes):
        raise UserError(f"{source}: module '{name}' has {fused.up.shape[0]} output rows, the target model's "
                        f"fused module has {sum(sizes)}; the LoRA was made for another model size")
    ups = torch.split(fused.up, sizes)
    spans = [_used_columns(up) for up in ups]
    used = [s for s in spans if s is not None]
    if used and all(a[1] <= b[0] for a, b in itertools.pairwise(used)):
        alphas = [_exact_alpha(fused.scale, s[1] - s[0]) if s else None for s in spans]
        if all(a is not None for a, s in zip(alphas, spans) if s is not None):
            return [LoraWeights(fused.down[s[0]:s[1]], up[:, s[0]:s[1]], a) if s else None
                    for up, s, a in zip(ups, spans, alphas)]
    return [LoraWeights(fused.down, up, fused.alpha) for up in ups]


def _fuse(parts: list[LoraWeights | None], rows: tuple[int, ...], name: str, source: str,
          notes: list[str]) -> LoraWeights:
    """Separate diffusers modules as one fused Kohya module (inverse of :func:`_split`)."""
    present = [p for p in parts if p is not None]
    width = present[0].down.shape[1]
    sizes = [r * width for r in rows]
    for p, size in zip(parts, sizes):
        if p is not None and p.up.shape[0] != size:
            raise UserError(f"{source}: a part of '{name}' has {p.up.shape[0]} output rows, the target model "
                            f"has {size}; the LoRA was made for another model size")
    scales = {p.scale for p in present}
    if len(present) == len(parts) and len(scales) == 1 and all(torch.equal(p.down, present[0].down) for p in present):
        # Parts that share one down (a split Kohya module): stack the ups back, same rank and alpha.
        return LoraWeights(present[0].down, torch.cat([p.up for p in parts]), present[0].alpha)
    if len(present) < len(parts) and len(scales) == 1 and len({p.rank for p in present}) == 1:
        # An absent part gets zero down rows and a zero up block of the same rank, so the fused module is
        # sd-scripts' split layout (equal rank per part, block-diagonal up), which diffusers' Kohya reader
        # splits back into each part's own down and up instead of copying the whole down into every part.
        like = present[0]
        parts = [p or LoraWeights(torch.zeros_like(like.down), like.up.new_zeros(size, *like.up.shape[1:]), like.alpha)
                 for p, size in zip(parts, sizes)]
        present = parts
    rank = sum(p.rank for p in present)
    alpha = _exact_alpha(scales.pop(), rank) if len(scales) == 1 else None
    fold = alpha is None
    if fold:
        alpha = float(rank)
        notes.append(f"'{name}': its parts have different scales (alpha/rank); the scales are folded into "
                     f"lora_up and alpha = rank = {rank}")
    dtype = present[0].up.dtype
    up = torch.zeros(sum(sizes), rank, dtype=dtype)
    row = col = 0
    for p, size in zip(parts, sizes):
        if p is not None:
            block = (p.up.float() * (p.scale / (alpha / rank))).to(dtype) if fold else p.up
            up[row:row + size, col:col + p.rank] = block
            col += p.rank
        row += size
    return LoraWeights(torch.cat([p.down for p in present]), up, alpha)


def kohya_to_diffusers(modules: Mapping[str, LoraWeights], keys: ModelKeys, source: str) -> dict[str, LoraWeights]:
    """Kohya-named modules -> diffusers-named modules (fused FLUX modules split into their parts)."""
    out = {}
    for name, m in modules.items():
        entry = keys.by_kohya.get(name)
        if entry is None:
            raise _unmapped(name, keys, source)
        if len(entry.diffusers) == 1:
            out[entry.diffusers[0]] = m
            continue
        for part_name, part in zip(entry.diffusers, _split(m, entry.rows, name, source)):
            if part is not None:
                out[part_name] = part
    return out


def diffusers_to_kohya(modules: Mapping[str, LoraWeights], keys: ModelKeys, source: str,
                       notes: list[str]) -> dict[str, LoraWeights]:
    """diffusers-named modules -> Kohya-named modules (FLUX q, k, v (, mlp) fused); folds go to ``notes``."""
    out = {}
    for name in modules:
        if name not in keys.by_diffusers:
            raise _unmapped(name, keys, source)
    for entry in keys.maps:
        parts = [modules.get(n) for n in entry.diffusers]
        if all(p is None for p in parts):
            continue
        out[entry.kohya] = parts[0] if len(parts) == 1 else _fuse(parts, entry.rows, entry.kohya, source, notes)
    return out


def mindspore_to_diffusers(modules: Mapping[str, LoraWeights], keys: ModelKeys, source: str) -> dict[str, LoraWeights]:
    """MindSpore port names (``lora_unet.<diffusers module>``) -> diffusers names (``unet.<module>``)."""
    prefixes = formats.kohya_prefixes(keys.model)
    out = {}
    for name, m in modules.items():
        prefix, _, module = name.partition(".")
        ours = f"{prefixes.get(prefix, prefix)}.{module}"
        if prefix not in prefixes or ours not in keys.by_diffusers:
            raise _unmapped(name, keys, source)
        out[ours] = m
    return out


def diffusers_to_mindspore(modules: Mapping[str, LoraWeights], keys: ModelKeys, source: str) -> dict[str, LoraWeights]:
    """diffusers names -> MindSpore port names (inverse of :func:`mindspore_to_diffusers`)."""
    prefixes = {v: k for k, v in formats.kohya_prefixes(keys.model).items()}
    out = {}
    for name, m in modules.items():
        component, _, module = name.partition(".")
        if component not in prefixes or name not in keys.by_diffusers:
            raise _unmapped(name, keys, source)
        out[f"{prefixes[component]}.{module}"] = m
    return out


def diffusers_check(modules: Mapping[str, LoraWeights], keys: ModelKeys, source: str) -> dict[str, LoraWeights]:
    """diffusers names, each checked to exist in the target model."""
    for name in modules:
        if name not in keys.by_diffusers:
            raise _unmapped(name, keys, source)
    return dict(modules)


# ------------------------------------------------------------------------------------------ files


@dataclass
class Lora:
    """A LoRA file read into modules named in its own layout, with what was detected about it."""

    path: Path
    container: str
    layout: str
    model: str | None
    modules: dict[str, LoraWeights]
    metadata: dict[str, str]

    @property
    def format(self) -> str:
        """e.g. 'kohya-flux', 'diffusers-sdxl', 'mindspore-sdxl'."""
        return f"{self.layout}-{self.model or 'unknown'}"


def read_lora(path: str | Path, model: str | None = None, configs: Mapping[str, Mapping] | None = None) -> Lora:
    """Read and classify a LoRA file; ``model`` (a family's name), when given, must be the one it was made for
    (``configs``: that model's size, as :func:`convert_lora` takes them)."""
    lora_file = read_lora_file(path)
    comfyui = formats.comfyui_as_peft(lora_file.tensors)
    if comfyui is not None:
        lora_file = dataclasses.replace(lora_file, tensors=comfyui)
    source = str(lora_file.path)
    layout = detect_layout(list(lora_file.tensors), source)
    modules = modules_from_file(lora_file, layout)
    guessed, evidence = guess_family(list(modules))
    if guessed is None and layout == "mindspore":
        guessed = _mindspore_family()
    if guessed is not None and guessed not in families():
        raise UserError(f"{source}: module '{evidence}' is {model_title(guessed)} naming; dreamstep converts "
                        f"{' and '.join(f.title for f in families().values())} LoRAs")
    if model is None and guessed is not None:
        guessed = _family_holding(modules, layout, guessed)
    if (model is not None and guessed is not None and guessed != model
            and not _names_fit(modules, layout, model, configs)):
        raise UserError(f"{source}: module '{evidence}' has no counterpart in {model_title(model)}; "
                        f"this LoRA looks made for {model_title(guessed)}")
    return Lora(lora_file.path, lora_file.container, layout, model or guessed, modules, lora_file.metadata)


def _names_fit(modules: Mapping[str, LoraWeights], layout: str, model: str,
               configs: Mapping[str, Mapping] | None) -> bool:
    """Whether every module is one of ``model``'s (FLUX.2's diffusers names hold FLUX.1's hints too)."""
    if layout not in ("kohya", "diffusers") or not _components_fit(modules, layout, model):
        return False  # without building the model's key tables (SDXL's builds its UNet)
    keys = model_keys(model, configs)
    known = keys.by_kohya if layout == "kohya" else keys.by_diffusers
    return layout in ("kohya", "diffusers") and all(name in known for name in modules)


def _components_fit(modules: Mapping[str, LoraWeights], layout: str, model: str) -> bool:
    """Whether every module's name starts with one of ``model``'s components (diffusers names) or file prefixes
    (sd-scripts' names)."""
    found = get_family(model)
    if layout == "kohya":
        return all(name.startswith(tuple(f"{prefix}_" for prefix in found.kohya_prefixes)) for name in modules)
    return all(name.split(".", 1)[0] in found.component_labels for name in modules)


def _family_holding(modules: Mapping[str, LoraWeights], layout: str, guessed: str) -> str:
    """The family whose released model has every module, when the names' hints may point at another: FLUX.2's,
    Krea 2's and Qwen-Image's diffusers names share FLUX.1's ``transformer.`` prefixes, and an attention-only LoRA
    of Krea 2 names only layers FLUX.1 has too. Where the names fit several, the layers' full-size shapes decide
    (Krea 2's attention is 6144 wide, FLUX.1's 3072); where they still do not, the hint stays."""
    holding = [name for name in families() if _names_fit(modules, layout, name, None)]
    if len(holding) > 1 and layout == "diffusers":
        holding = [name for name in holding if _shapes_fit(modules, name)] or holding
    if len(holding) == 1:
        return holding[0]
    return guessed


def _shapes_fit(modules: Mapping[str, LoraWeights], model: str) -> bool:
    shapes = weight_shapes(model, None)
    return all(lora_shape_problem(name, m.down, m.up, shapes) is None for name, m in modules.items())


def _mindspore_family() -> str:
    """The family the MindSpore port trains (its files name no model)."""
    return next(f.name for f in families().values() if f.mindspore_port)


def to_diffusers(lora: Lora, keys: ModelKeys) -> dict[str, LoraWeights]:
    """A read LoRA's modules under diffusers names, each checked to exist in ``keys``' model."""
    source = str(lora.path)
    if lora.layout == "kohya":
        return kohya_to_diffusers(lora.modules, keys, source)
    if lora.layout == "mindspore":
        return mindspore_to_diffusers(lora.modules, keys, source)
    return diffusers_check(lora.modules, keys, source)


def _keys_for(lora: Lora, configs: Mapping[str, Mapping] | None) -> ModelKeys:
    if lora.model is None:
        raise UserError(f"{lora.path}: cannot tell which model this LoRA is for (it adapts only text encoders); "
                        f"pass --model ({' or '.join(families())})")
    return model_keys(lora.model, configs)


def load_lora_as_diffusers(path: str | Path, model: str, configs: Mapping[str, Mapping] | None = None
                           ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Any LoRA file as a diffusers-layout state dict that ``pipe.load_lora_weights(state_dict)`` loads with
    the right scales, and the file's metadata. diffusers reads no alpha from an in-memory dict, so each
    module's alpha/rank is folded into lora_B. ``configs`` (from :func:`pipeline_configs` or
    :func:`folder_configs`) names the model's size; without it, the released model's."""
    lora = read_lora(path, model, configs)
    modules = fold_alpha(to_diffusers(lora, _keys_for(lora, configs)))
    return diffusers_state_dict(modules), lora.metadata


def convert_lycoris(src: Path, dst: Path, to: str, model: str | None, configs: Mapping[str, Mapping] | None,
                    cast_to: torch.dtype | None) -> Converted | None:
    """A LyCORIS file: a DoRA (or plain LoRA) into the diffusers/PEFT layout, which peft's DoRA holds; anything
    else one line, as no layout ``convert`` writes holds LoKr, LoHa or Tucker. None for a file of no LyCORIS."""
    lora_file = read_lora_file(src)
    if not is_lycoris(lora_file.tensors):
        return None
    lycoris = read_lycoris(src, model, lora_file)
    converted = None
    if to == "diffusers" and lycoris.model is not None:
        keys = model_keys(lycoris.model, configs)
        converted = dora_as_diffusers(lycoris, keys, weight_shapes(lycoris.model, configs))
    if converted is None:
        what = "/".join(lycoris.algorithms) + (" (DoRA)" if any("DoRA" in m.settings for m in lycoris.modules.values())
                                               else "")
        by_column = any(m.by_column for m in lycoris.modules.values())
        only = ("only a DoRA by output row (wd_on_output=True) or a plain LoRA goes --to diffusers; this DoRA has a "
                "magnitude per input column" if by_column else "only a DoRA or plain LoRA goes --to diffusers")
        raise UserError(f"{src}: a {what} file in LyCORIS' layout, which --to {to} cannot hold ({only}); "
                        f"{lycoris_readers(lycoris.model)} read this file as it is")
    tensors, metadata = converted
    if cast_to is not None:
        tensors = {k: v.to(cast_to) for k, v in tensors.items()}
    dst.parent.mkdir(parents=True, exist_ok=True)  # a missing output folder is made, once the file converts
    write_lora_file(dst, tensors, {**metadata, "dreamstep_converted_from": f"lycoris-{lycoris.model}"},
                    container_for(dst))
    return Converted(lycoris, f"diffusers-{lycoris.model}", container_for(dst), len(lycoris.modules), [])


@dataclass
class Converted:
    """What :func:`convert_lora` did."""

    source: Lora | LycorisFile
    target_format: str
    container: str
    modules: int
    notes: list[str]


def convert_lora(src: str | Path, dst: str | Path, to: str, model: str | None = None, dtype: str | None = None,
                 configs: Mapping[str, Mapping] | None = None, overwrite: bool = False) -> Converted:
    """Convert ``src`` to layout ``to`` ('kohya', 'diffusers', 'mindspore') at ``dst`` (the suffix picks the
    container). How a diffusers-layout file carries alpha: :func:`diffusers_file_contents`."""
    if to not in LAYOUTS:
        raise UserError(f"--to {to}: unknown layout; use one of {', '.join(LAYOUTS)}{did_you_mean(to, LAYOUTS)}")
    cast_to = dtype_named(dtype, "--dtype") if dtype is not None else None
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise UserError(f"{dst} exists; choose another output path or pass --overwrite")
    if dst.resolve() == src.resolve():
        raise UserError(f"{dst}: the output must not be the input file")
    if any(folder.exists() and not folder.is_dir() for folder in (dst.parent, *dst.parent.parents)):
        raise UserError(f"{dst}: {dst.parent} is not a folder (a file is in its path); choose another output path")
    container = "mindspore" if to == "mindspore" else container_for(dst)
    if to == "mindspore" and dst.suffix.lower() != ".ckpt":
        raise UserError(f"{dst}: a MindSpore checkpoint must end in .ckpt")
    lycoris = convert_lycoris(src, dst, to, model, configs, cast_to)
    if lycoris is not None:
        return lycoris
    lora = read_lora(src, model, configs)
    keys = _keys_for(lora, configs)
    if to == "mindspore" and keys.model != _mindspore_family():
        raise UserError(f"--to mindspore: the MindSpore port's layout exists for {model_title(_mindspore_family())} "
                        f"only, this LoRA is for {model_title(keys.model)}")
    notes: list[str] = []
    ours = to_diffusers(lora, keys)
    if to == "kohya":
        out = diffusers_to_kohya(ours, keys, str(src), notes)
    elif to == "mindspore":
        out = diffusers_to_mindspore(ours, keys, str(src))
    else:
        out = ours
        if any(m.alpha != m.rank for m in ours.values()):
            notes.append("alpha/rank is folded into lora_B (alpha = rank), the one form diffusers and ComfyUI "
                         "both apply at the trained strength")
    source_count = len(lora.modules)
    if len(out) != source_count and keys.fuses_modules:
        fused = len(out) < source_count
        notes.append(f"{source_count} modules became {len(out)}: sd-scripts' FLUX layout fuses the attention's q, k "
                     f"and v (and a single block's q, k, v and MLP input) into one module whose rank is the sum of "
                     f"its parts' ranks; {'they were stacked' if fused else 'they were split back'}, the weights "
                     "unchanged")
    if dtype is not None:
        out = {k: LoraWeights(m.down.to(cast_to), m.up.to(cast_to), m.alpha) for k, m in out.items()}
    if to == "diffusers":
        tensors, metadata = diffusers_file_contents(out, container)
    else:
        tensors = kohya_state_dict(out)
        metadata = {}
    if container == "safetensors":
        carried = {k: v for k, v in lora.metadata.items() if k not in (formats.ADAPTER_METADATA_KEY, "format")}
        metadata = {**carried, **metadata, "dreamstep_converted_from": lora.format}
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_lora_file(dst, tensors, metadata, container)
    return Converted(lora, f"{to}-{keys.model}", container, len(out), notes)
