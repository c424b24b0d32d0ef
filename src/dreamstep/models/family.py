"""What dreamstep knows of one family of text-to-image models (FLUX.1, SDXL, ...), and the registry that finds them.

A family is a package under ``dreamstep/models/`` whose ``family`` module defines ``FAMILY``, an object with the
members of :class:`ModelFamily`. Nothing in ``engine/``, ``data/``, ``lora/`` or the dashboard names a family: they
ask the registry (:func:`get_family`, :func:`family_of_pipeline`, :func:`guess_family`, :func:`variant_family`) and
call these members. The ``family`` module imports neither torch nor diffusers at import time (the registry reads
every family's facts for ``--help`` and for telling a LoRA file's model), so its methods import what they build.

When each member is used, and its shapes in and out:

- facts (``name`` ... ``mindspore_port``): read by the CLI, ``lora info``/``convert``, ``plan`` and the dashboard.
- :meth:`ModelFamily.lora_keys`: converting and checking LoRA files (:mod:`dreamstep.lora.convert`).
- :meth:`ModelFamily.lora_targets`: building a LoRA on the denoiser, in a trainer and in its memory plan.
- :meth:`ModelFamily.meta_components`, :meth:`ModelFamily.training_pass`, :meth:`ModelFamily.loop_text_encoders`:
  the memory plan (:mod:`dreamstep.models.plans`), on the meta device.
- :meth:`ModelFamily.released_components`: full-size weight shapes (``lora info``, the ComfyUI key checks).
- :attr:`ModelFamily.commands`: the ``train``, ``generate`` and ``eval`` commands :mod:`dreamstep.cli` lists.
- :meth:`ModelFamily.check_generation_model`, :meth:`ModelFamily.generation_pipeline`,
  :meth:`ModelFamily.sampling_defaults`, :meth:`ModelFamily.image_inputs`: ``generate`` and ``eval``.
- :attr:`ModelFamily.variants`: the names ``tiny-model`` and ``plan`` take; :meth:`ModelFamily.build_tiny`,
  :meth:`ModelFamily.write_single_files`: ``tiny-model`` (:func:`dreamstep.models.tiny.write_tiny_model`).

See ``docs/adding-a-family.md`` for the files a new family writes.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from dreamstep.errors import UserError, did_you_mean

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image
    from torch import nn

    from dreamstep.models.lora_keys import ModelKeys

__all__ = ["ModelFamily", "all_variants", "check_blocks_to_swap", "families", "family_of_pipeline", "get_family",
           "guess_family", "model_title", "variant_family"]


@runtime_checkable
class ModelFamily(Protocol):
    """The members every family has (see the module docstring for when each is used)."""

    name: str
    """The family's name in commands and files: ``flux``, ``sdxl``."""
    title: str
    """Its name in sentences: ``FLUX.1``."""
    released_name: str
    """The released model planned and shape-checked when no model folder is given: ``FLUX.1-dev``."""
    pipeline_classes: tuple[str, ...]
    """The diffusers pipeline classes (``model_index.json``'s ``_class_name``) of this family's model folders."""
    denoiser: str
    """The pipeline component that a LoRA trains: ``transformer`` or ``unet``."""
    component_labels: Mapping[str, str]
    """Every pipeline component the trainers load, denoiser first, with its label in the plan."""
    long_text_encoder: str | None
    """The text encoder read to ``--max_sequence_length`` and quantized by ``--text_encoder_quantization`` (FLUX's
    T5); ``None`` where every encoder reads 77 tokens."""
    resolution_step: int
    """Image sides are multiples of this (the VAE's factor times the denoiser's patch size)."""
    kohya_prefixes: Mapping[str, str]
    """sd-scripts' file prefix of each adapted component: ``{"lora_unet": "transformer", "lora_te1": ...}``."""
    key_hints: tuple[str, ...]
    """Substrings of LoRA module or key names that only this family's files have, checked before any family's
    :attr:`weak_key_hints`."""
    weak_key_hints: tuple[str, ...]
    """Substrings that tell this family when no family's strong hint matched."""
    lycoris_readers: str
    """Who reads this family's LyCORIS files as written, for ``lora info``."""
    mindspore_port: bool
    """Whether the MindSpore port (mindone) trains this family, so its ``.ckpt`` layout converts."""
    commands: Mapping[tuple[str, ...], tuple[str, str, str | None]]
    """The family's commands (``train``, ``generate``, ``eval``), each ``(summary, runner, options)`` as
    :class:`dreamstep.cli.Command` takes them; the second word of ``generate`` and ``eval`` is a variant."""

    def lora_keys(self, configs: Mapping[str, Mapping] | None) -> ModelKeys:
        """The key tables of the model with these component configs (``{component: config.json}``); ``None``: the
        released model's."""

    def lora_targets(self, denoiser: nn.Module, layers: Sequence[str]) -> list[str]:
        """The full module names a LoRA adapts in ``denoiser``, from one preset name or module-name suffixes (a
        trainer's ``--lora_layers``); a suffix that matches nothing is a UserError."""

    def meta_components(self, folder: Path | None, variant: str | None = None) -> dict[str, nn.Module]:
        """Every component of :attr:`component_labels` built on the meta device from ``folder``'s configs (or,
        without a folder, the released model of ``variant``, or the family's :attr:`released_name`), in bf16, for
        the memory plan."""

    def training_pass(self, denoiser: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool,
                      image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                      ) -> Callable[[], torch.Tensor | None]:
        """One forward of ``denoiser`` (on the meta device) as the trainer calls it: a square image of
        ``resolution`` px (its latent tokens times ``image_token_multiplier`` for a model that reads a condition
        image's tokens beside the target's), ``text_tokens`` of text, ``batch`` samples, with the trainer's fp32
        inputs when ``train`` (returning a loss) and the pipeline's otherwise (returning None). ``trainable``: a
        module trained beside the frozen denoiser (a ControlNet), fed as the trainer feeds it."""

    def loop_text_encoders(self, *, long_encoder_trains: bool) -> tuple[str, ...]:
        """The text encoders a training step runs when its text encoders train (FLUX: CLIP, and T5 only when
        ``long_encoder_trains``; SDXL: both)."""

    def released_components(self, configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
        """The denoiser and text encoders built empty (no memory) from full-size ``configs`` (the released
        model's, as :meth:`released_configs` gives them, with a folder's configs over them), for weight shapes."""

    def released_configs(self) -> dict[str, dict[str, Any]]:
        """The released model's configs of the denoiser and text encoders."""

    variants: Mapping[str, int]
    """The model variants users name (``tiny-model flux-kontext``, ``plan flux-kontext``), each with the images whose
    latent tokens the denoiser reads per sample: 1, or 2 for an edit model that reads its reference image's tokens
    beside the target's."""

    def build_tiny(self, variant: str, *, seed: int, guidance_embeds: bool) -> DiffusionPipeline:
        """A tiny random pipeline of ``variant`` (every block type of the real model, a few dozen channels wide) that
        the family's diffusers pipeline class loads; ``guidance_embeds``: the guidance-distilled kind, where the
        family has one (a UserError where it has not)."""

    def check_generation_model(self, variant: str, model: str, model_config: str | None,
                               component_files: Mapping[str, str]) -> None:
        """One UserError line naming ``--model`` (or ``--model_config``, or a component file's flag) when the base is
        not there or is another family's, before anything loads (``generate``, ``eval``)."""

    def generation_pipeline(self, variant: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                            component_files: Mapping[str, str], controlnet: Any | None) -> DiffusionPipeline:
        """The diffusers pipeline that samples ``variant``, loaded on the CPU in ``dtype`` with its sampler set; the
        caller places it on the device (or offloads it) and applies LoRAs. ``controlnet``: what ``--controlnet``
        names, where the family has ControlNets."""

    def sampling_defaults(self, variant: str, pipe: DiffusionPipeline, images: Sequence[Image.Image]
                          ) -> dict[str, Any]:
        """``steps``, ``guidance_scale``, ``width`` and ``height`` when the user gives none, for a call with these
        input images (an edit's references, a control image)."""

    def image_inputs(self, variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
        """The pipeline call's keyword arguments for the input images at the size asked for; ``{}`` when there are
        none."""

    def check_single_files(self, variant: str) -> None:
        """Refuse ``tiny-model --single_file`` for a variant whose users have no single files."""

    def write_single_files(self, pipe: DiffusionPipeline, out_dir: Path) -> None:
        """Beside a tiny pipeline folder, the single files the family's users have (ComfyUI's, sd-scripts'), so the
        single-file loading paths run in tests."""


@cache
def families() -> dict[str, ModelFamily]:
    """Every family, by name: each package under ``dreamstep.models`` that has a ``family`` module."""
    import dreamstep.models

    found: dict[str, ModelFamily] = {}
    for package in pkgutil.iter_modules(dreamstep.models.__path__):
        if not package.ispkg:
            continue
        try:
            module = importlib.import_module(f"dreamstep.models.{package.name}.family")
        except ModuleNotFoundError as error:
            if error.name == f"dreamstep.models.{package.name}.family":
                continue
            raise
        found[module.FAMILY.name] = module.FAMILY
    return dict(sorted(found.items()))


def get_family(name: str, flag: str = "--model") -> ModelFamily:
    """The family called ``name``; an unknown name is a UserError naming ``flag`` and the known ones."""
    known = families()
    if name not in known:
        raise UserError(f"{flag} {name}: unknown model family{did_you_mean(name, known)}; use one of "
                        f"{', '.join(known)}")
    return known[name]


def family_of_pipeline(class_name: str) -> ModelFamily | None:
    """The family whose diffusers pipeline is ``class_name`` (a ``model_index.json``'s ``_class_name``)."""
    return next((f for f in families().values() if class_name in f.pipeline_classes), None)


# LoRA names of models no family trains, to name them in an error rather than call a file unknown.
OTHER_MODELS = {"sd1": "Stable Diffusion 1.x/2.x"}
_OTHER_HINTS = (("lora_unet_down_blocks", "sd1"), ("lora_unet_mid_block", "sd1"), ("lora_unet_up_blocks", "sd1"),
                ("lora_te_", "sd1"))


def model_title(name: str) -> str:
    """A family's (or another known model's) name in sentences."""
    known = families()
    return known[name].title if name in known else OTHER_MODELS.get(name, name)


def guess_family(names: Sequence[str]) -> tuple[str | None, str | None]:
    """(family name, the first name that tells) from LoRA module or key names: every family's strong hints
    first, then the weak ones, then the models no family trains (``sd1``)."""
    known = families().values()
    hints = ([(h, f.name) for f in known for h in f.key_hints] + [(h, f.name) for f in known for h in f.weak_key_hints]
             + list(_OTHER_HINTS))
    for hint, model in hints:
        for name in names:
            if hint in name:
                return model, name
    return None, None


def variant_family(variant: str) -> ModelFamily | None:
    """The family that has the model variant ``variant`` (``flux-kontext``: FLUX.1)."""
    return next((f for f in families().values() if variant in f.variants), None)


def all_variants() -> tuple[str, ...]:
    """Every family's variants, for a command's choices."""
    return tuple(variant for found in families().values() for variant in found.variants)


def check_blocks_to_swap(blocks_to_swap: int, block_count: int, flag: str = "--blocks_to_swap") -> None:
    """The one rule for ``--blocks_to_swap``: 0 (none) up to every one of the model's ``block_count`` repeated blocks
    (diffusers' ``_repeated_blocks``; the swapper brings each to the device while it runs). The trainers and the
    memory plan (so ``plan`` and the dashboard) swap through :func:`dreamstep.models.blocks.swapped_blocks`, which
    applies it (flux-kohya counts as sd-scripts does)."""
    if not 0 <= blocks_to_swap <= block_count:
        raise UserError(f"{flag} {blocks_to_swap}: the model has {block_count} blocks; choose 0 to {block_count}")
