"""Options of ``dreamstep eval VARIANT``: one class for every family's variants (the command:
:mod:`dreamstep.commands.evaluate`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dreamstep.config.choices import CHECKPOINT_WEIGHTS_HELP
from dreamstep.config.evaluation import CONTROL_METRICS, DEFAULT_CLIP_MODEL, DEFAULT_DINO_MODEL, FIDELITY_METRICS
from dreamstep.config.options import FluxComponentFileOptions
from dreamstep.config.schema import option
from dreamstep.errors import UserError, did_you_mean
from dreamstep.files import check_folder_can_be_made


@dataclass
class EvalConfig(FluxComponentFileOptions):
    """The options of ``dreamstep eval VARIANT``."""


    model: str = option(help="the base model the LoRAs or ControlNets were trained on (folder, hub id or file)")
    weights: list[str] = option(help="LoRA files, checkpoint-N folders, ControlNet folders or run folders")
    output_dir: str = option(help="where scores.csv, scores.json, the plots and the samples are written")
    checkpoint_weights: Literal["auto", "ema", "raw"] = option("auto", CHECKPOINT_WEIGHTS_HELP)
    prompt: list[str] = option([], "prompts to generate (repeat or list several)")
    from_file: str | None = option(None, "text file with one prompt per line, instead of --prompt")
    instance_data_dir: str | None = option(None, "the subject's images (needed for dino and clip_i)")
    control_image: list[str] = option([], "ControlNet control images: one, or one per prompt")
    image: list[str] = option([], "edit models (eval flux-kontext): the images the prompts edit: one, or one per "
                                  "prompt")
    metrics: list[str] = option(["dino", "clip_i", "clip_t"], "dino, clip_i, clip_t; edge for ControlNets; "
                                "val_loss: the held-out loss a run logged (run or checkpoint-N folders of a run "
                                "trained with --validation_split or a validation subset)", aliases=("eval_metrics",))
    best_by: str | None = option(None, "metric that names the best candidate (default: the first --metrics)",
                                 aliases=("eval_best_by",))
    identifier: str | None = option("sks", "identifier token taken out of prompts for clip_t ('none': keep)")
    num_images: int = option(4, "images per prompt, seeds --seed, --seed + 1, ...")
    seed: int = option(0, "seed of each prompt's first image")
    steps: int | None = option(None, "sampling steps (default: the model's, as generate: FLUX.1-dev 28, SDXL 50)")
    guidance_scale: float | None = option(None, "guidance (default: the model's, as generate: FLUX.1-dev 3.5, "
                                                "SDXL 7)")
    resolution: int | None = option(None, "image side in pixels (default: the model's native size)")
    model_config: str | None = option(None, "for a single-file --model: the folder or hub id with its configs (and "
                                            "the FLUX parts not given by --clip_l, --t5xxl, --ae)")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = option("auto", "precision; auto: fp32 on CPU, bf16/fp16 on GPU")
    device: str | None = option(None, "cpu, cuda, cuda:N or mps (default: the best available)")
    dino_model: str = option(DEFAULT_DINO_MODEL, "DINO model id or folder (ViT-S/16, as in the DreamBooth paper)")
    clip_model: str = option(DEFAULT_CLIP_MODEL, "CLIP model id or folder")
    batch_size: int = option(16, "images per batch through the evaluation models")

    def __post_init__(self) -> None:
        self.metrics = list(dict.fromkeys(m.strip() for v in self.metrics for m in v.split(",") if m.strip()))
        check_folder_can_be_made(self.output_dir, "--output_dir")  # made at the first image: refused now
        allowed = FIDELITY_METRICS + CONTROL_METRICS + ("val_loss",)
        for name in self.metrics:
            if name not in allowed:
                raise UserError(f"--metrics: unknown metric '{name}'{did_you_mean(name, allowed)}; "
                                f"choose from {', '.join(allowed)}")
        if not self.metrics:
            raise UserError("--metrics is empty; choose from " + ", ".join(allowed))
        self.best_by = self.best_by or self.metrics[0]
        if self.best_by not in self.metrics:
            raise UserError(f"--best_by {self.best_by}: not among --metrics ({', '.join(self.metrics)})")
        if bool(self.prompt) == (self.from_file is not None):
            raise UserError("give --prompt or --from_file (one of them)")
        if {"dino", "clip_i"} & set(self.metrics) and self.instance_data_dir is None:
            raise UserError("dino and clip_i compare with the subject's images: give --instance_data_dir")
        if "edge" in self.metrics and not self.control_image:
            raise UserError("--metrics edge needs --control_image (an edge map)")
        if self.image and self.control_image:
            raise UserError("--image is what FLUX.1 Kontext edits, --control_image a ControlNet's input: give one")
        for flag in ("num_images", "batch_size", "steps", "resolution"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise UserError(f"--{flag} must be at least 1 (got {getattr(self, flag)})")
