"""``dreamstep eval``'s ``val_loss``: the validation loss a flux-lora, sdxl-lora or flux-controlnet run logged, for
that run's checkpoints and saved weights (and the base model), so that eval ranks them as the trainer did. The
trainer's own code computes it (``held_out_images`` / ``held_out_loss`` of the recipe in :data:`_TRAINERS`): the
images or pairs the run held out, chosen from its ``config.toml`` as training chose them, scored at the same
fixed noise levels and draws. A LoRA is scored on the pipeline's denoiser (and text encoders), where eval applies
it; a ControlNet beside the transformer.

The paths in ``config.toml`` are as training was given them: relative ones are read from the folder training ran
in, which the run folder tells (its path less the ``output_dir`` it was given), so eval may run from anywhere."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dreamstep.config.schema import build_config, load_toml
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset
from dreamstep.errors import UserError
from dreamstep.evaluation.candidates import Candidate, training_folder

METRIC = "val_loss"


# The trainers whose runs eval scores, told apart by their config.toml: the config class and the recipe module.
_TRAINERS = {"flux-controlnet": ("dreamstep.config.flux_controlnet:FluxControlNetConfig",
                                 "dreamstep.recipes.flux_controlnet"),
             "flux-lora": ("dreamstep.config.flux_lora:FluxLoraConfig", "dreamstep.recipes.flux_lora"),
             "sdxl-lora": ("dreamstep.config.sdxl_lora:SDXLLoraConfig", "dreamstep.recipes.sdxl_lora")}


@dataclass
class _Run:
    trainer: str
    config: Any  # the trainer's config class
    folder: Path  # where training ran
    held_out: BucketDataset


class RunLosses:
    """The held-out validation loss of each candidate that comes from a run of one of :data:`_TRAINERS` (``nan`` for
    the others); the base model's on the held-out data when every such candidate comes from one run."""

    def __init__(self, candidates: list[Candidate]):
        """Reads each run's config and chooses its held-out data, before any model loads: a run that held out
        nothing, or whose data is not where its config says, is one error line."""
        self.runs: dict[Path, _Run] = {}
        for candidate in candidates:
            if candidate.config_dir is not None and candidate.config_dir not in self.runs:
                self.runs[candidate.config_dir] = _held_out(candidate.config_dir)
        if not self.runs:
            raise UserError(f"--metrics {METRIC} is the held-out loss of flux-lora, sdxl-lora and flux-controlnet "
                            f"runs: give a run folder or its checkpoint-N folders in --weights, or drop {METRIC}")
        self.losses: dict[Path, Callable[[torch.nn.Module | None], float]] = {}

    def encode(self, pipeline: Any, device: torch.device, work_dir: Path) -> None:
        """Encode every run's held-out data once with ``pipeline`` (the base model); the text embeddings are
        cached under ``work_dir``."""
        text_cache = TensorCache(work_dir / "text", "eval")
        for config_dir, run in self.runs.items():
            recipe = importlib.import_module(_TRAINERS[run.trainer][1])
            with contextlib.chdir(run.folder):
                loss = recipe.held_out_loss(run.config, run.held_out, pipeline, text_cache, device)
            self.losses[config_dir] = loss if run.trainer == "flux-controlnet" else _of_pipeline(loss)

    def __call__(self, candidate: Candidate | None, controlnet: torch.nn.Module | None) -> float:
        """``candidate``'s loss, with its LoRA applied to the pipeline or its loaded ``controlnet``; ``None``: the
        base model's."""
        if candidate is None:
            return next(iter(self.losses.values()))(None) if len(self.losses) == 1 else math.nan
        loss = self.losses.get(candidate.config_dir)
        return loss(controlnet) if loss is not None else math.nan


def _of_pipeline(loss: Callable[[], float]) -> Callable[[torch.nn.Module | None], float]:
    """A LoRA run's loss, which reads the LoRA from the pipeline, called as a ControlNet run's is."""
    return lambda _: loss()


def _trainer_of(config: dict[str, Any]) -> str | None:
    if "num_double_layers" in config or "controlnet_weights_dtype" in config:
        return "flux-controlnet"
    if "v_parameterization" in config:
        return "sdxl-lora"
    return "flux-lora" if "rank" in config and "conditioning_data_dir" not in config else None


def _held_out(run: Path) -> _Run:
    file = run / "config.toml"
    trainer = _trainer_of(load_toml(file))
    if trainer is None:
        raise UserError(f"--metrics {METRIC}: {run} is not a flux-lora, sdxl-lora or flux-controlnet run, the "
                        f"trainers whose validation loss eval recomputes; drop {METRIC}")
    config_path, recipe_name = _TRAINERS[trainer]
    module, name = config_path.split(":")
    config = build_config(getattr(importlib.import_module(module), name), {}, toml_path=file)
    recipe = importlib.import_module(recipe_name)
    folder = training_folder(run, config.output_dir)
    try:
        with contextlib.chdir(folder):
            held_out = recipe.held_out_images(config)
    except UserError as e:
        raise UserError(f"--metrics {METRIC}: {file}'s data, read from {folder}: {e}") from None
    if held_out is None:
        raise UserError(f"--metrics {METRIC}: {run} held out nothing (it trained without --validation_split or a "
                        f"validation subset), so it has no validation loss; drop {METRIC}")
    return _Run(trainer, config, folder, held_out)
