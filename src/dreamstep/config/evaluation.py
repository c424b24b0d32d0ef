"""Options every trainer shares for evaluation: the held-out validation loss and the DreamBooth
fidelity scores of validation samples (see :mod:`dreamstep.evaluation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dreamstep.config.schema import option, refuse_unused
from dreamstep.errors import UserError, did_you_mean

FIDELITY_METRICS = ("dino", "clip_i", "clip_t")
CONTROL_METRICS = ("edge",)
DEFAULT_DINO_MODEL = "facebook/dino-vits16"
DEFAULT_CLIP_MODEL = "openai/clip-vit-base-patch32"
NO_VALIDATION_LOSS = ("--eval_best_by val_loss: this run holds out no images, so it has no validation loss; add "
                      "--validation_split (e.g. 0.1) or held-out images, or pick one of --eval_metrics")


@dataclass
class EvaluationOptions:
    validation_split: float = option(
        0.0, "fraction of the training images held out for a deterministic validation loss (0: none)",
        bounds="[0, 1)", kw_only=True)
    eval_metrics: list[str] = option(
        [], "scores of the validation samples: dino, clip_i, clip_t (flux-controlnet also: edge, the agreement "
            "of the sample's edges with an edge-map control image)", kw_only=True)
    eval_best_by: Optional[str] = option(
        None, "metric that names the best checkpoint (default: val_loss with a held-out set, else the first "
              "--eval_metrics)", kw_only=True)
    eval_identifier: Optional[str] = option(
        "sks", "the identifier token taken out of prompts for CLIP-T ('none' keeps prompts as they are)", kw_only=True)
    dino_model: str = option(DEFAULT_DINO_MODEL, "DINO model for --eval_metrics dino (hub id or folder; "
                                                     "ViT-S/16 as in the DreamBooth paper)", kw_only=True)
    clip_model: str = option(DEFAULT_CLIP_MODEL, "CLIP model for clip_i / clip_t (hub id or folder)",
                             kw_only=True)
    eval_batch_size: int = option(16, "images per batch through the evaluation models", bounds="[1, inf)",
                                  kw_only=True)

    # The metrics a trainer computes (a ControlNet's adds the control metrics).
    metrics_allowed: ClassVar[tuple[str, ...]] = FIDELITY_METRICS

    def check_group(self) -> None:
        """Refuse unknown metric names and a split outside [0, 1) before any model loads; accepts
        ``--eval_metrics dino,clip_i`` as well as ``--eval_metrics dino clip_i``."""
        allowed = self.metrics_allowed
        self.eval_metrics = list(dict.fromkeys(m.strip() for v in self.eval_metrics for m in v.split(",") if m.strip()))
        if not self.eval_metrics:
            refuse_unused(self, ("eval_identifier", "dino_model", "clip_model", "eval_batch_size"),
                          "without --eval_metrics")
        for name in self.eval_metrics:
            if name not in allowed:
                raise UserError(f"--eval_metrics: unknown metric '{name}'{did_you_mean(name, allowed)}; "
                                f"choose from {', '.join(allowed)}")
        if self.eval_best_by is not None:
            known = ("val_loss", *self.eval_metrics)
            if self.eval_best_by not in known:
                raise UserError(f"--eval_best_by {self.eval_best_by}: not a metric of this run"
                                f"{did_you_mean(self.eval_best_by, known)}; choose from {', '.join(known)}")
        if self.eval_best_by == "val_loss" and not self.may_hold_out_images():
            raise UserError(NO_VALIDATION_LOSS)

    def may_hold_out_images(self) -> bool:
        """Whether the run can have held-out images, as far as the flags tell before the data is read: a
        split, or a dataset TOML (its ``is_validation`` subsets). A trainer with a validation folder adds it."""
        return self.validation_split > 0 or getattr(self, "dataset_config", None) is not None

    def best_metric(self, has_validation_loss: bool) -> str | None:
        """The metric that picks the best checkpoint."""
        if self.eval_best_by is not None:
            return self.eval_best_by
        if has_validation_loss:
            return "val_loss"
        return self.eval_metrics[0] if self.eval_metrics else None
