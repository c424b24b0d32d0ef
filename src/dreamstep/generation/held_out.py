"""``dreamstep eval``'s ``val_loss``: the validation loss a flux-controlnet run logged, for that run's checkpoints and
saved ControlNet (and the base model), so that eval ranks them as the trainer did. The trainer's own code computes
it (:func:`dreamstep.recipes.flux_controlnet.held_out_loss`): the pairs the run held out, chosen from its
``config.toml`` as training chose them, scored at the same fixed noise levels and draws.

The paths in ``config.toml`` are as training was given them: relative ones are read from the folder training ran
in, which the run folder tells (its path less the ``output_dir`` it was given), so eval may run from anywhere."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dreamstep.config.schema import build_config
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset
from dreamstep.errors import UserError
from dreamstep.evaluation.candidates import Candidate, training_folder

METRIC = "val_loss"


@dataclass
class _Run:
    config: Any  # FluxControlNetConfig
    folder: Path  # where training ran
    held_out: BucketDataset


class RunLosses:
    """The held-out validation loss of each candidate that comes from a flux-controlnet run (``nan`` for the
    others); the base model's on the held-out pairs when every such candidate comes from one run."""

    def __init__(self, candidates: list[Candidate]):
        """Reads each run's config and chooses its held-out pairs, before any model loads: a run that held out
        nothing, or whose data is not where its config says, is one error line."""
        self.runs: dict[Path, _Run] = {}
        for candidate in candidates:
            if candidate.kind != "lora" and candidate.config_dir is not None and candidate.config_dir not in self.runs:
                self.runs[candidate.config_dir] = _held_out(candidate.config_dir)
        if not self.runs:
            raise UserError(f"--metrics {METRIC} is the held-out loss of flux-controlnet runs: give a run folder or "
                            f"its checkpoint-N folders in --weights, or drop {METRIC}")
        self.losses: dict[Path, Callable[[torch.nn.Module | None], float]] = {}

    def encode(self, pipeline: Any, device: torch.device, work_dir: Path) -> None:
        """Encode every run's held-out pairs once with ``pipeline`` (the base model); the text embeddings are
        cached under ``work_dir``."""
        from dreamstep.recipes.flux_controlnet import held_out_loss

        text_cache = TensorCache(work_dir / "text", "eval")
        for config_dir, run in self.runs.items():
            with contextlib.chdir(run.folder):
                self.losses[config_dir] = held_out_loss(run.config, run.held_out, pipeline, text_cache, device)

    def __call__(self, candidate: Candidate | None, controlnet: torch.nn.Module | None) -> float:
        """``candidate``'s loss with its loaded ``controlnet``; ``None``: the base model's."""
        if candidate is None:
            return next(iter(self.losses.values()))(None) if len(self.losses) == 1 else math.nan
        loss = self.losses.get(candidate.config_dir) if candidate.kind != "lora" else None
        return loss(controlnet) if loss is not None else math.nan


def _held_out(run: Path) -> _Run:
    from dreamstep.config.flux_controlnet import FluxControlNetConfig
    from dreamstep.recipes.flux_controlnet import split_pairs, training_datasets

    file = run / "config.toml"
    config = build_config(FluxControlNetConfig, {}, toml_path=file)
    folder = training_folder(run, config.output_dir)
    try:
        with contextlib.chdir(folder):
            _, held_out = split_pairs(config, training_datasets(config))
    except UserError as e:
        raise UserError(f"--metrics {METRIC}: {file}'s data, read from {folder}: {e}") from None
    if held_out is None:
        raise UserError(f"--metrics {METRIC}: {run} held out no pairs (it trained without --validation_split or a "
                        f"validation subset), so it has no validation loss; drop {METRIC}")
    return _Run(config, folder, held_out)
