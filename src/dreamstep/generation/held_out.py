"""``dreamstep eval``'s ``val_loss``: the validation loss a flux-lora, sdxl-lora or flux-controlnet run logged, for
that run's checkpoints and saved weights (and the base model), so that eval ranks them as the trainer did. The
trainer's own code computes it (``held_out_images`` / ``held_out_loss`` of its recipe, :class:`_Trainer`): the
images or pairs the run held out, chosen from its ``config.toml`` as training chose them, scored at the same
fixed noise levels and draws. A LoRA is scored on the pipeline's denoiser (and text encoders), where eval applies
it; a ControlNet beside the transformer.

The paths in ``config.toml`` are as training was given them: relative ones are read from the folder training ran
in, which the run folder tells (its path less the ``output_dir`` it was given), so eval may run from anywhere."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from dreamstep.config.schema import build_config, load_toml
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset
from dreamstep.errors import UserError
from dreamstep.evaluation.candidates import Candidate, training_folder
from dreamstep.models.family import get_family, model_title

METRIC = "val_loss"


@dataclass(frozen=True)
class _Trainer:
    """A trainer whose recipe gives its held-out loss: ``held_out_images(config)`` and ``held_out_loss(config,
    held_out, pipeline, text_cache, device)``."""

    name: str
    options: type  # its config class
    recipe: ModuleType
    scores_a_module: bool  # its loss takes the trained module (a ControlNet); else it reads the pipeline's LoRA


@cache
def _trainers(family: str) -> tuple[_Trainer, ...]:
    """The trainers of ``family`` (of the command table) whose recipe computes its held-out loss for eval."""
    from dreamstep.cli import COMMANDS

    found = []
    for key, command in COMMANDS.items():
        ours = key[0] == "train" and key in get_family(family).commands
        recipe = importlib.import_module(command.runner.partition(":")[0]) if ours else None
        if recipe is not None and hasattr(recipe, "held_out_loss"):
            module, _, name = command.options.partition(":")
            found.append(_Trainer(key[1], getattr(importlib.import_module(module), name), recipe,
                                  getattr(recipe, "HELD_OUT_LOSS_OF_MODULE", False)))
    return tuple(found)


def _names(family: str, conjunction: str) -> str:
    names = [trainer.name for trainer in _trainers(family)]
    return f"{', '.join(names[:-1])} {conjunction} {names[-1]}" if len(names) > 1 else names[0]


@dataclass
class _Run:
    trainer: _Trainer
    config: Any  # the trainer's config class
    folder: Path  # where training ran
    held_out: BucketDataset


class RunLosses:
    """The held-out validation loss of each candidate that comes from a run of such a trainer (``nan`` for the
    others); the base model's on the held-out data when every such candidate comes from one run."""

    def __init__(self, candidates: list[Candidate], family: str):
        """Reads each run's config and chooses its held-out data, before any model loads: a run that held out
        nothing, or whose data is not where its config says, is one error line. ``family``: the model's (eval's
        variant's), whose trainers wrote the runs (:func:`check_family` first)."""
        self.runs: dict[Path, _Run] = {}
        for candidate in candidates:
            if candidate.config_dir is not None and candidate.config_dir not in self.runs:
                self.runs[candidate.config_dir] = _held_out(candidate.config_dir, family)
        if not self.runs:
            raise UserError(f"--metrics {METRIC} is the held-out loss of {_names(family, 'and')} runs: give a run "
                            f"folder or its checkpoint-N folders in --weights, or drop {METRIC}")
        self.losses: dict[Path, Callable[[torch.nn.Module | None], float]] = {}

    def encode(self, pipeline: Any, device: torch.device, work_dir: Path) -> None:
        """Encode every run's held-out data once with ``pipeline`` (the base model); the text embeddings are
        cached under ``work_dir``."""
        text_cache = TensorCache(work_dir / "text", "eval")
        for config_dir, run in self.runs.items():
            with contextlib.chdir(run.folder):
                loss = run.trainer.recipe.held_out_loss(run.config, run.held_out, pipeline, text_cache, device)
            self.losses[config_dir] = loss if run.trainer.scores_a_module else _of_pipeline(loss)

    def __call__(self, candidate: Candidate | None, controlnet: torch.nn.Module | None) -> float:
        """``candidate``'s loss, with its LoRA applied to the pipeline or its loaded ``controlnet``; ``None``: the
        base model's."""
        if candidate is None:
            return next(iter(self.losses.values()))(None) if len(self.losses) == 1 else math.nan
        loss = self.losses.get(candidate.config_dir)
        return loss(controlnet) if loss is not None else math.nan


def check_family(family: str) -> None:
    """Refuse, before anything is read, a family none of whose trainers gives eval its held-out loss."""
    if not _trainers(family):
        raise UserError(f"--metrics {METRIC}: eval does not recompute the validation loss of {model_title(family)} "
                        f"runs (their train.log and metrics.csv have it); drop {METRIC}")


def _of_pipeline(loss: Callable[[], float]) -> Callable[[torch.nn.Module | None], float]:
    """A LoRA run's loss, which reads the LoRA from the pipeline, called as a ControlNet run's is."""
    return lambda _: loss()


def _trainer_of(values: dict[str, Any], family: str) -> _Trainer | None:
    """The trainer of ``family`` that wrote a run's ``config.toml`` (``values``): the one whose options hold every
    key, and of several, the one with the fewest options (``config.toml`` writes the run's resolved options but
    those left ``None``)."""
    keys = set(values)
    fitting = [t for t in _trainers(family) if keys <= {f.name for f in dataclasses.fields(t.options)}]
    return min(fitting, key=lambda t: len(dataclasses.fields(t.options)), default=None)


def _held_out(run: Path, family: str) -> _Run:
    file = run / "config.toml"
    trainer = _trainer_of(load_toml(file), family)
    if trainer is None:
        raise UserError(f"--metrics {METRIC}: {run} is not a run of {_names(family, 'or')}, the {model_title(family)} "
                        f"trainers whose validation loss eval recomputes (the others log it in train.log and "
                        f"metrics.csv); drop {METRIC}")
    config = build_config(trainer.options, {}, toml_path=file)
    folder = training_folder(run, config.output_dir)
    try:
        with contextlib.chdir(folder):
            held_out = trainer.recipe.held_out_images(config)
    except UserError as e:
        raise UserError(f"--metrics {METRIC}: {file}'s data, read from {folder}: {e}") from None
    if held_out is None:
        raise UserError(f"--metrics {METRIC}: {run} held out nothing (it trained without --validation_split or a "
                        f"validation subset), so it has no validation loss; drop {METRIC}")
    return _Run(trainer, config, folder, held_out)
