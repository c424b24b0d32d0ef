"""``dreamstep eval``'s ``val_loss``: the validation loss a run logged, for that run's checkpoints and saved weights
(LoRAs or a ControlNet) and the base model, so that eval ranks them as the trainer did. The trainer's own code
computes it: each recipe's ``held_out_loss`` (see docs/adding-a-family.md, "The recipe protocol"), on the images
the run held out, chosen from its ``config.toml`` as training chose them (:mod:`dreamstep.data.holdout`), scored
at the same fixed noise levels and draws.

The trainer is the one of the evaluated family whose options hold every key of the run's ``config.toml``. The
paths in ``config.toml`` are as training was given them: relative ones are read from the folder training ran in,
which the run folder tells (its path less the ``output_dir`` it was given), so eval may run from anywhere."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from dreamstep.config.schema import build_config, load_toml
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset
from dreamstep.data.holdout import build_split_datasets
from dreamstep.errors import UserError
from dreamstep.evaluation.candidates import Candidate, training_folder
from dreamstep.models.family import variant_family

METRIC = "val_loss"


@dataclass
class _Run:
    recipe: ModuleType  # the trainer's recipe module: its held_out_loss
    config: Any  # the trainer's config
    folder: Path  # where training ran
    held_out: BucketDataset


class RunLosses:
    """The held-out validation loss of each candidate that comes from a run (``nan`` for the others); the base
    model's on the held-out images when every such candidate comes from one run."""

    def __init__(self, candidates: list[Candidate], model_type: str):
        """Reads each run's config and chooses its held-out images, before any model loads: a run that held out
        nothing, whose trainer cannot recompute its loss, or whose data is not where its config says, is one
        error line."""
        self.runs: dict[Path, _Run] = {}
        for candidate in candidates:
            if candidate.config_dir is not None and candidate.config_dir not in self.runs:
                self.runs[candidate.config_dir] = _held_out(candidate.config_dir, model_type)
        if not self.runs:
            raise UserError(f"--metrics {METRIC} is the held-out loss a run logged: give a run folder or its "
                            f"checkpoint-N folders in --weights, or drop {METRIC}")
        self.losses: dict[Path, Callable[[torch.nn.Module | None], float]] = {}

    def encode(self, pipeline: Any, device: torch.device, work_dir: Path) -> None:
        """Encode every run's held-out images once with ``pipeline`` (the base model); the text embeddings are
        cached under ``work_dir``."""
        text_cache = TensorCache(work_dir / "text", "eval")
        for config_dir, run in self.runs.items():
            with contextlib.chdir(run.folder):
                self.losses[config_dir] = run.recipe.held_out_loss(run.config, run.held_out, pipeline, text_cache,
                                                                   device)

    def __call__(self, candidate: Candidate | None, controlnet: torch.nn.Module | None) -> float:
        """``candidate``'s loss with the pipeline as it is now (a LoRA candidate's weights applied to it) and its
        loaded ``controlnet``; ``None``: the base model's."""
        if candidate is None:
            return next(iter(self.losses.values()))(None) if len(self.losses) == 1 else math.nan
        loss = self.losses.get(candidate.config_dir)
        return loss(controlnet) if loss is not None else math.nan


def trainer_of(run: Path, model_type: str) -> tuple[str, type, ModuleType]:
    """The trainer of ``model_type``'s family that wrote ``run`` (the one whose options hold every key of its
    ``config.toml``): its name, config class and recipe module."""
    from dreamstep.cli import COMMANDS

    keys = set(load_toml(run / "config.toml", "--weights"))
    family = variant_family(model_type)
    for (group, name), command in COMMANDS.items():  # the commands' option classes import nothing heavy
        if group != "train" or (group, name) not in family.commands:
            continue
        module, _, class_name = command.options.partition(":")
        options = getattr(importlib.import_module(module), class_name)
        fields = {f.name for f in dataclasses.fields(options)}
        fields |= {a for f in dataclasses.fields(options) for a in f.metadata.get("aliases", ())}
        if keys <= fields:
            return name, options, importlib.import_module(command.runner.partition(":")[0])
    raise UserError(f"--metrics {METRIC}: {run / 'config.toml'} is not the config of a {family.title} trainer; give "
                    f"runs of {model_type}'s family, or drop {METRIC}")


def _held_out(run: Path, model_type: str) -> _Run:
    name, options, recipe = trainer_of(run, model_type)
    if not hasattr(recipe, "held_out_loss"):
        raise UserError(f"--metrics {METRIC}: {run} is a {name} run, whose validation loss eval does not "
                        f"recompute; drop {METRIC}")
    file = run / "config.toml"
    config = build_config(options, {}, toml_path=file)
    folder = training_folder(run, config.output_dir)
    try:
        with contextlib.chdir(folder):
            _, held_out = build_split_datasets(recipe.training_datasets(config), config.seed,
                                               config.validation_split)
    except UserError as e:
        raise UserError(f"--metrics {METRIC}: {file}'s data, read from {folder}: {e}") from None
    if held_out is None:
        raise UserError(f"--metrics {METRIC}: {run} held out no images (it trained without --validation_split or a "
                        f"validation subset), so it has no validation loss; train with --validation_split, or "
                        f"drop {METRIC}")
    return _Run(recipe, config, folder, held_out)
