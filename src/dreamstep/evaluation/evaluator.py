"""What a trainer scores at each validation point: the held-out validation loss, the DreamBooth fidelity
scores of the validation samples, and for ControlNet the samples' agreement with their control images.
Built once per run from the evaluation options."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dreamstep.config.evaluation import FIDELITY_METRICS, NO_VALIDATION_LOSS, EvaluationOptions
from dreamstep.data.dataset import BucketDataset, make_dataloader
from dreamstep.data.images import load_rgb
from dreamstep.errors import UserError
from dreamstep.evaluation.control import mean_edge_agreement
from dreamstep.evaluation.fidelity import FidelityScorer
from dreamstep.evaluation.validation_loss import LossAt, ValidationLoss
from dreamstep.models.precision import autocast


class RunEvaluator:
    """Call with the validation samples (and their prompts and control images) to get the step's scores."""

    def __init__(self, validation_loss: ValidationLoss | None, scorer: FidelityScorer | None,
                 identifier: str | None, edge: bool = False):
        self.validation_loss = validation_loss
        self.scorer = scorer
        self.identifier = identifier
        self.edge = edge

    def __call__(self, images: Sequence[Image.Image], prompts: Sequence[str],
                 controls: Sequence[Image.Image] = ()) -> dict[str, float]:
        scores: dict[str, float] = {}
        if self.validation_loss is not None:
            scores["val_loss"] = self.validation_loss()
        if self.scorer is not None and images:
            scores |= self.scorer.score(images, prompts, self.identifier)
        if self.edge and images:
            scores["edge"] = mean_edge_agreement(images, controls)
        return scores


def held_out_batches(held_out: BucketDataset, conditioner: Any, seed: int) -> list[dict[str, Any]]:
    """The held-out images as step inputs (latent posteriors, prompt embeddings), computed once."""
    return [conditioner(batch) for batch in make_dataloader(held_out, seed=seed)]


def held_out_loss_of(held_out: BucketDataset, conditioner: Any, *, seed: int, device: torch.device,
                     mixed_precision: str,
                     step_for: Callable[[torch.nn.Module | None], tuple[LossAt, Sequence[torch.nn.Module]]]
                     ) -> Callable[[torch.nn.Module | None], float]:
    """A run's validation loss as ``dreamstep eval`` recomputes it (each recipe's ``held_out_loss``): ``held_out``
    encoded once by ``conditioner``, then, for a module beside the base (a ControlNet; ``None``: the base, with
    whatever LoRA eval applied to it), scored as the run scored it: ``step_for`` gives the run's step's
    ``validation_loss_at`` and the modules it puts in eval mode, under the run's ``--mixed_precision``."""
    batches = held_out_batches(held_out, conditioner, seed)

    def loss(module: torch.nn.Module | None) -> float:
        loss_at, modules = step_for(module)
        with autocast(device.type, mixed_precision):
            return ValidationLoss(batches, loss_at, seed=seed, modules=modules)()

    return loss


def load_scorer(options: EvaluationOptions) -> FidelityScorer | None:
    """The DINO / CLIP models that ``--eval_metrics`` asks for, on the CPU; called before the base model
    loads, so a missing evaluation model is one error line and nothing else happens."""
    fidelity = [m for m in options.eval_metrics if m in FIDELITY_METRICS]
    if not fidelity:
        return None
    return FidelityScorer(fidelity, dino_model=options.dino_model, clip_model=options.clip_model,
                          batch_size=options.eval_batch_size)


def build_evaluator(options: EvaluationOptions, scorer: FidelityScorer | None, *, held_out: BucketDataset | None,
                    conditioner: Any, loss_at: LossAt, modules: Sequence[torch.nn.Module], seed: int,
                    subject_images: Sequence[Path], device: torch.device) -> RunEvaluator | None:
    """The run's evaluator, or ``None`` when neither a held-out set nor ``--eval_metrics`` is given. The
    scorer moves to the training device and embeds the subject's images once."""
    if held_out is None and options.eval_best_by == "val_loss":
        raise UserError(NO_VALIDATION_LOSS)  # a dataset TOML without is_validation subsets
    if held_out is None and not options.eval_metrics:
        return None
    validation_loss = None
    if held_out is not None:
        validation_loss = ValidationLoss(held_out_batches(held_out, conditioner, seed), loss_at, seed=seed,
                                         modules=modules)
    if scorer is not None:
        scorer.to(device)
        scorer.set_references([load_rgb(Path(p)) for p in subject_images])
    return RunEvaluator(validation_loss, scorer, options.eval_identifier, edge="edge" in options.eval_metrics)
