"""``dreamstep eval VARIANT`` (``flux``, ``flux-kontext``, ``sdxl``, ...): which checkpoint to keep, in numbers.

Scores any set of LoRA files, ``checkpoint-N`` folders, FLUX ControlNet folders and whole run folders (each
expanded into its checkpoints and final weights), plus the base model alone as the baseline (step 0), on
the same prompts with the same seeds: DINO and CLIP-I against the subject's images (``--instance_data_dir``),
CLIP-T against the prompts with the identifier taken out, and for ControlNets the edge agreement with
``--control_image``; for the LoRAs of an edit model (FLUX.1 Kontext) each prompt edits its ``--image`` (score
the edits against the "after" images with ``--instance_data_dir``). Works on what every trainer writes.

Writes into ``--output_dir``: ``scores.csv`` and ``scores.json`` (one row per candidate: label, path, step,
scores; the JSON also names the best candidate per metric), ``<metric>.png`` (the metric over training
steps, the best one circled) and ``samples/<n>.png`` (each candidate's images), then names the best
candidate by ``--best_by``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from PIL import Image
from tqdm.auto import tqdm

from dreamstep.config.choices import CHECKPOINT_WEIGHTS_HELP
from dreamstep.config.evaluation import CONTROL_METRICS, FIDELITY_METRICS
from dreamstep.config.options import FluxComponentFileOptions
from dreamstep.config.schema import add_arguments, build_config, option
from dreamstep.data.images import list_images, load_rgb
from dreamstep.engine.logging import save_image_grid
from dreamstep.engine.metrics import MetricsTable, draw_metrics, higher_is_better
from dreamstep.errors import UserError, did_you_mean
from dreamstep.evaluation.candidates import Candidate, find_candidates
from dreamstep.evaluation.control import mean_edge_agreement
from dreamstep.evaluation.fidelity import DEFAULT_CLIP_MODEL, DEFAULT_DINO_MODEL, FidelityScorer
from dreamstep.generation.loras import LoraSpec, apply_loras, check_lora, remove_loras
from dreamstep.generation.pipelines import build_pipeline, check_model, choose_dtype, default_size
from dreamstep.models.family import variant_family
from dreamstep.models.flux import generation as flux_generation
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.precision import choose_device

BASELINE = "base model"


@dataclass
class EvalConfig(FluxComponentFileOptions):
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
    metrics: list[str] = option(["dino", "clip_i", "clip_t"], "dino, clip_i, clip_t; edge for ControlNets",
                                aliases=("eval_metrics",))
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
        allowed = FIDELITY_METRICS + CONTROL_METRICS
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


def _prompts(config: EvalConfig) -> list[str]:
    if config.prompt:
        return config.prompt
    path = Path(config.from_file).expanduser()
    if not path.is_file():
        raise UserError(f"--from_file {path}: file not found; check the path")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--from_file {path}: no prompts in the file; write one prompt per line")
    return prompts


def _per_prompt(values: list[str], flag: str, prompts: list[str]) -> list[Image.Image | None]:
    """The images of ``flag`` (control images, or the images Kontext edits), one per prompt."""
    if not values:
        return [None] * len(prompts)
    if len(values) not in (1, len(prompts)):
        raise UserError(f"{len(values)} {flag} values for {len(prompts)} prompts; give one, or one per prompt")
    images = []
    for text in values:
        path = Path(text).expanduser()
        if not path.is_file():
            raise UserError(f"{flag} {path}: file not found; check the path")
        images.append(load_rgb(path))
    return images * len(prompts) if len(images) == 1 else images


class Generator:
    """The base pipeline with one candidate's weights applied at a time; fixed seeds per image."""

    def __init__(self, config: EvalConfig, model_type: str):
        self.config, self.model_type = config, model_type
        self.device = choose_device(config.device)
        self.dtype = choose_dtype(config.dtype, self.device)
        self.family = variant_family(model_type)
        self.pipe = build_pipeline(model_type, config.model, model_config=config.model_config, dtype=self.dtype,
                                   component_files=config.component_files(), device=self.device)
        defaults = self.family.sampling_defaults(model_type, self.pipe, [])
        self.steps = config.steps or defaults["steps"]
        self.guidance = config.guidance_scale if config.guidance_scale is not None else defaults["guidance_scale"]
        self.size = config.resolution or default_size(self.pipe)

    def images(self, candidate: Candidate | None, prompts: list[str], controls: list[Image.Image | None]
               ) -> list[Image.Image]:
        """``controls``: ControlNet control images, or the images Kontext edits."""
        pipe = self.pipe
        with_control = _edits(self.model_type) or (candidate is not None and candidate.kind != "lora")
        if candidate is not None and candidate.kind == "lora":
            apply_loras(self.pipe, [LoraSpec(candidate.path)], self.family.name, merge=False)
        elif candidate is not None:
            pipe = self._with_controlnet(candidate)
        try:
            return [image for prompt, control in zip(prompts, controls)
                    for image in self._generate(pipe, prompt, control if with_control else None)]
        finally:
            if candidate is not None and candidate.kind == "lora":
                remove_loras(self.pipe)

    def _generate(self, pipe: Any, prompt: str, control: Image.Image | None) -> list[Image.Image]:
        extra = self.family.image_inputs(self.model_type, [control] if control is not None else [], self.size,
                                         self.size)
        out = []
        for i in range(self.config.num_images):
            generator = torch.Generator("cpu").manual_seed(self.config.seed + i)
            out.append(pipe(prompt=prompt, num_inference_steps=self.steps, guidance_scale=self.guidance,
                            height=self.size, width=self.size, generator=generator, **extra).images[0])
        return out

    def _with_controlnet(self, candidate: Candidate) -> Any:
        """The base pipeline's components (no copies) with the candidate FLUX ControlNet: a folder, or a
        flux-controlnet run's checkpoint."""
        if candidate.kind == "controlnet":
            controlnet = flux_generation.load_controlnet(str(candidate.path), self.dtype)
        else:
            controlnet = flux_generation.controlnet_from_checkpoint(candidate.path, candidate.config_dir,
                                                                    self.pipe.transformer, self.dtype)
        return flux.assemble_pipeline(SimpleNamespace(**self.pipe.components), controlnet.to(self.device))


def _model_type(key: tuple[str, ...]) -> str:
    return key[-1]


def _edits(model_type: str) -> bool:
    """Whether the variant edits an input image (its denoiser reads the input's tokens beside the target's)."""
    return variant_family(model_type).variants[model_type] > 1


def evaluate(config: EvalConfig, model_type: str) -> dict[str, Any]:
    """Score the baseline and every candidate; write the tables, plots and samples; return the JSON summary.
    Every candidate is read first, so a damaged file or another model's LoRA is one line before anything
    loads or is written."""
    family = variant_family(model_type)
    edit_variants = [v for v in family.variants if _edits(v)]
    if _edits(model_type) and not config.image:
        raise UserError(f"eval {model_type} scores edits: give --image (the images the prompts edit)")
    if not _edits(model_type) and config.image:
        use = f"use eval {' or eval '.join(edit_variants)}, or remove it" if edit_variants else "remove it"
        raise UserError(f"--image is the image an edit model edits; {model_type} generates from the prompt: {use}")
    check_model(model_type, config.model, config.model_config, config.component_files())
    with tempfile.TemporaryDirectory(prefix="dreamstep-eval-") as work_dir:  # checkpoints written as LoRA files
        candidates = find_candidates(config.weights, Path(work_dir), config.checkpoint_weights)
        for candidate in candidates:
            if candidate.kind == "lora":
                check_lora(candidate.path, family.name)
        return _score(config, model_type, candidates)


def _score(config: EvalConfig, model_type: str, candidates: list[Candidate]) -> dict[str, Any]:
    out = Path(config.output_dir)
    if model_type != "flux" and any(c.kind != "lora" for c in candidates):
        raise UserError("ControlNets are FLUX-only here; use 'dreamstep eval flux'")
    if "edge" in config.metrics and not any(c.kind != "lora" for c in candidates):
        raise UserError("--metrics edge scores ControlNets; none of --weights is a ControlNet")
    prompts = _prompts(config)
    controls = _per_prompt(config.image or config.control_image, "--image" if config.image else "--control_image",
                           prompts)
    fidelity = [m for m in config.metrics if m in FIDELITY_METRICS]
    references = ([load_rgb(p) for p in list_images(Path(config.instance_data_dir), "--instance_data_dir")]
                  if config.instance_data_dir else [])
    scorer = FidelityScorer(fidelity, dino_model=config.dino_model, clip_model=config.clip_model,
                            batch_size=config.batch_size) if fidelity else None
    generator = Generator(config, model_type)
    if scorer is not None:
        scorer.to(generator.device)
        scorer.set_references(references)
    rows = []
    for index, candidate in enumerate(tqdm([None, *candidates], desc="eval", unit="candidate")):
        images = generator.images(candidate, prompts, controls)
        image_prompts = [p for p in prompts for _ in range(config.num_images)]
        scores = scorer.score(images, image_prompts, config.identifier) if scorer is not None else {}
        if "edge" in config.metrics:
            scores["edge"] = mean_edge_agreement(images, [c for c in controls for _ in range(config.num_images)])
        sample = save_image_grid(images, out / "samples" / f"{index:02d}-{_slug(candidate)}.png",
                                 columns=config.num_images)
        rows.append({"label": candidate.label if candidate else BASELINE,
                     "path": str(candidate.source or candidate.path) if candidate else config.model,
                     "step": candidate.step if candidate else 0, "samples": str(sample), **scores})
    return write_results(rows, config.metrics, config.best_by, out)


def _slug(candidate: Candidate | None) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", candidate.label if candidate else "base")


def write_results(rows: list[dict[str, Any]], metrics: list[str], best_by: str, out: Path) -> dict[str, Any]:
    """``scores.csv``, ``scores.json`` and one ``<metric>.png`` per metric over steps; the summary."""
    out.mkdir(parents=True, exist_ok=True)
    best = {m: max(rows, key=lambda r: r[m] if higher_is_better(m) else -r[m])["label"] for m in metrics}
    summary = {"best_by": best_by, "best": best[best_by], "best_per_metric": best, "candidates": rows}
    with (out / "scores.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["label", "path", "step", *metrics, "samples"])
        writer.writeheader()
        writer.writerows([{**r, **{m: f"{r[m]:.6g}" for m in metrics}} for r in rows])
    (out / "scores.json").write_text(json.dumps(summary, indent=2))
    for metric in metrics:
        table = MetricsTable()
        for row in rows:
            if row["step"] is not None:
                table.add(row["step"], {metric: row[metric]})
        best_step = next(r["step"] for r in rows if r["label"] == best[metric])
        draw_metrics(table, out / f"{metric}.png", columns=1, marks={metric: best_step} if best_step is not None
                     else None)
    return summary


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(parser, EvalConfig)


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    config = build_config(EvalConfig, args)
    summary = evaluate(config, _model_type(key))
    out = Path(config.output_dir)
    print(f"\n{'candidate':<40} {'step':>6}  " + "  ".join(f"{m:>8}" for m in config.metrics))
    for row in summary["candidates"]:
        step = "" if row["step"] is None else row["step"]
        print(f"{row['label'][:40]:<40} {step!s:>6}  " + "  ".join(f"{row[m]:8.4f}" for m in config.metrics))
    print(f"\nbest by {config.best_by}: {summary['best']}")
    print(f"wrote: {out / 'scores.csv'}, {out / 'scores.json'}, "
          + ", ".join(str(out / f"{m}.png") for m in config.metrics) + f", {out / 'samples'}")
