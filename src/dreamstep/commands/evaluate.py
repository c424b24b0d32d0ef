"""``dreamstep eval VARIANT`` (``flux``, ``flux-kontext``, ``sdxl``, ...): which checkpoint to keep, in numbers.

Scores any set of LoRA files, ``checkpoint-N`` folders, FLUX ControlNet folders and whole run folders (each
expanded into its checkpoints and final weights; of a run that saved an EMA beside its weights, those
``--checkpoint_weights`` chooses), plus the base model alone as the baseline (step 0), on
the same prompts with the same seeds: DINO and CLIP-I against the subject's images (``--instance_data_dir``),
CLIP-T against the prompts with the identifier taken out, and for ControlNets the edge agreement with
``--control_image``; and ``val_loss``, for the checkpoints and saved weights (and the base model) of a run that
held out images (a LoRA run of flux-lora, sdxl-lora, ... or a flux-controlnet run): the validation loss the trainer
logged, computed by its own code on the same held-out images (so ``--best_by val_loss`` names the checkpoint the
trainer named best); for the LoRAs of an edit model (FLUX.1 Kontext) each prompt edits its ``--image`` (score
the edits against the "after" images with ``--instance_data_dir``). Works on what every trainer writes.

Writes into ``--output_dir``: ``scores.csv`` and ``scores.json`` (one row per candidate: label, path, step,
scores; the JSON also names the best candidate per metric), ``<metric>.png`` (the metric over training
steps, the best one circled) and ``samples/<n>.png`` (each candidate's images), then names the best
candidate by ``--best_by``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dreamstep.config.evaluate import EvalConfig
from dreamstep.config.schema import add_arguments, build_config


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(parser, EvalConfig)


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    config = build_config(EvalConfig, args)
    from dreamstep.generation.evaluate import evaluate
    from dreamstep.notices import hide_transformers_progress_bars

    hide_transformers_progress_bars()
    summary = evaluate(config, key[-1])
    out = Path(config.output_dir)
    print(f"\n{'candidate':<40} {'step':>6}  " + "  ".join(f"{m:>8}" for m in config.metrics))
    for row in summary["candidates"]:
        step = "" if row["step"] is None else row["step"]
        print(f"{row['label'][:40]:<40} {step!s:>6}  " + "  ".join(f"{row[m]:8.4f}" for m in config.metrics))
    print(f"\nbest by {config.best_by}: {summary['best'] or 'none (no candidate has a finite score)'}")
    print(f"wrote: {out / 'scores.csv'}, {out / 'scores.json'}, "
          + ", ".join(str(out / f"{m}.png") for m in config.metrics) + f", {out / 'samples'}")
