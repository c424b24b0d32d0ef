"""The shape of a family's LoRA key tables: which module of sd-scripts' (Kohya) naming is which module of
diffusers' naming, in one concrete model (its block and layer counts).

A family writes its facts (per-block tables, fused modules) in its own package and expands them into a
:class:`ModelKeys` with :func:`kohya_name` and :func:`text_encoder_maps`; :mod:`dreamstep.lora.convert` maps
files through the result without knowing the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Final


@dataclass(frozen=True)
class ModuleMap:
    """One Kohya module and the diffusers module(s) it is; ``rows`` gives fused parts' output rows in units
    of the module's input width."""

    kohya: str
    diffusers: tuple[str, ...]
    rows: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class ModelKeys:
    """Every module a LoRA may adapt in one concrete model, in the Kohya and diffusers namings; ``model`` is
    the family's name (:mod:`dreamstep.models.family`)."""

    model: str
    description: str
    maps: tuple[ModuleMap, ...]

    @cached_property
    def by_kohya(self) -> dict[str, ModuleMap]:
        return {m.kohya: m for m in self.maps}

    @cached_property
    def by_diffusers(self) -> dict[str, ModuleMap]:
        return {name: m for m in self.maps for name in m.diffusers}

    @cached_property
    def fuses_modules(self) -> bool:
        """Whether one Kohya module stands for several diffusers modules (FLUX's fused q, k, v)."""
        return any(len(m.diffusers) > 1 for m in self.maps)


def kohya_name(prefix: str, module: str) -> str:
    """sd-scripts' name of a module: its dotted path with underscores, after ``prefix``."""
    return f"{prefix}_{module.replace('.', '_')}"


def text_encoder_maps(prefix: str, component: str, templates: tuple[str, ...], layers: int) -> list[ModuleMap]:
    """The maps of a text encoder's ``layers`` layers; Hugging Face module names are the same in every layout."""
    return [ModuleMap(kohya_name(prefix, t.format(i=i)), (f"{component}.{t.format(i=i)}",))
            for i in range(layers) for t in templates]


# CLIP's adapted linears per layer ``{i}`` (CLIP-L in FLUX.1 and SDXL, OpenCLIP bigG in SDXL).
CLIP_LAYER: Final = tuple(
    f"text_model.encoder.layers.{{i}}.{m}"
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
)
