"""``dreamstep eval``'s work: the base pipeline and each candidate's images on fixed seeds, their scores, and the
tables, plots and sample grids (the command and its options: :mod:`dreamstep.commands.evaluate`)."""

from __future__ import annotations

import csv
import json
import math
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image
from tqdm.auto import tqdm

from dreamstep.config.evaluate import EvalConfig
from dreamstep.config.evaluation import FIDELITY_METRICS
from dreamstep.data.images import list_images, load_rgb
from dreamstep.engine.logging import save_image_grid
from dreamstep.engine.metrics import MetricsTable, draw_metrics, higher_is_better
from dreamstep.errors import UserError
from dreamstep.evaluation.candidates import Candidate, find_candidates
from dreamstep.evaluation.control import mean_edge_agreement
from dreamstep.evaluation.fidelity import FidelityScorer
from dreamstep.generation.held_out import METRIC as VAL_LOSS
from dreamstep.generation.held_out import RunLosses
from dreamstep.generation.loras import LoraSpec, apply_loras, check_lora, remove_loras
from dreamstep.generation.pipelines import build_pipeline, check_model, choose_dtype, default_size
from dreamstep.models.family import variant_family
from dreamstep.models.flux import generation as flux_generation
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.precision import choose_device

BASELINE = "base model"


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

    @contextmanager
    def applied(self, candidate: Candidate | None) -> Iterator[None]:
        """The pipeline with ``candidate``'s LoRA applied (as it is for the base model and ControlNets)."""
        if candidate is None or candidate.kind != "lora":
            yield
            return
        apply_loras(self.pipe, [LoraSpec(candidate.path)], self.family.name, merge=False)
        try:
            yield
        finally:
            remove_loras(self.pipe)

    def images(self, prompts: list[str], controls: list[Image.Image | None],
               controlnet: torch.nn.Module | None = None) -> list[Image.Image]:
        """The pipeline's images (a LoRA applied with :meth:`applied`); ``controls``: ControlNet control images,
        or the images Kontext edits; ``controlnet``: a ControlNet candidate's model (:meth:`controlnet`)."""
        pipe = self.pipe
        with_control = _edits(self.model_type) or controlnet is not None
        if controlnet is not None:
            pipe = flux.assemble_pipeline(SimpleNamespace(**self.pipe.components), controlnet)
        return [image for prompt, control in zip(prompts, controls)
                for image in self._generate(pipe, prompt, control if with_control else None)]

    def _generate(self, pipe: Any, prompt: str, control: Image.Image | None) -> list[Image.Image]:
        extra = self.family.image_inputs(self.model_type, [control] if control is not None else [], self.size,
                                         self.size)
        out = []
        for i in range(self.config.num_images):
            generator = torch.Generator("cpu").manual_seed(self.config.seed + i)
            out.append(pipe(prompt=prompt, num_inference_steps=self.steps, guidance_scale=self.guidance,
                            height=self.size, width=self.size, generator=generator, **extra).images[0])
        return out

    def controlnet(self, candidate: Candidate | None) -> torch.nn.Module | None:
        """The candidate's FLUX ControlNet on the device (a folder, or a flux-controlnet run's checkpoint);
        ``None`` for the base model and LoRAs."""
        if candidate is None or candidate.kind == "lora":
            return None
        if candidate.kind == "controlnet":
            controlnet = flux_generation.load_controlnet(str(candidate.path), self.dtype)
        else:
            controlnet = flux_generation.controlnet_from_checkpoint(candidate.path, candidate.config_dir,
                                                                    self.pipe.transformer, self.dtype)
        return controlnet.to(self.device)


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
    # Checkpoints written as LoRA files, the held-out captions' embeddings for val_loss.
    with tempfile.TemporaryDirectory(prefix="dreamstep-eval-") as work_dir:
        candidates = find_candidates(config.weights, Path(work_dir), config.checkpoint_weights)
        for candidate in candidates:
            if candidate.kind == "lora":
                check_lora(candidate.path, family.name)
        return _score(config, model_type, candidates, Path(work_dir))


def _score(config: EvalConfig, model_type: str, candidates: list[Candidate], work_dir: Path) -> dict[str, Any]:
    out = Path(config.output_dir)
    if model_type != flux_generation.CONTROLNET_VARIANT and any(c.kind != "lora" for c in candidates):
        raise UserError(f"ControlNets are FLUX.1's here; use 'dreamstep eval {flux_generation.CONTROLNET_VARIANT}'")
    if "edge" in config.metrics and not any(c.kind != "lora" for c in candidates):
        raise UserError("--metrics edge scores ControlNets; none of --weights is a ControlNet")
    if any(c.kind != "lora" for c in candidates) and not config.control_image:
        raise UserError("a ControlNet among --weights generates from a control image: give --control_image")
    losses = RunLosses(candidates, model_type) if VAL_LOSS in config.metrics else None
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
    if losses is not None:
        losses.encode(generator.pipe, generator.device, work_dir)
    rows = []
    for index, candidate in enumerate(tqdm([None, *candidates], desc="eval", unit="candidate")):
        controlnet = generator.controlnet(candidate)
        with generator.applied(candidate):
            images = generator.images(prompts, controls, controlnet)
            scores = {VAL_LOSS: losses(candidate, controlnet)} if losses is not None else {}
        image_prompts = [p for p in prompts for _ in range(config.num_images)]
        if scorer is not None:
            scores |= scorer.score(images, image_prompts, config.identifier)
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
    best = {m: _best(rows, m) for m in metrics}
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
        best_step = next((r["step"] for r in rows if r["label"] == best[metric]), None)
        draw_metrics(table, out / f"{metric}.png", columns=1, marks={metric: best_step} if best_step is not None
                     else None)
    return summary




def _best(rows: list[dict[str, Any]], metric: str) -> str | None:
    """The label of the row with the best finite value of ``metric`` (the first on ties), ``None`` if none has
    one (a val_loss of a candidate from no run, an edge score of a blank control)."""
    scored = [r for r in rows if math.isfinite(r[metric])]
    if not scored:
        return None
    sign = 1.0 if higher_is_better(metric) else -1.0
    return max(scored, key=lambda r: sign * r[metric])["label"]
