"""What every trainer does around the loop: claim the output folder, set up devices and logging, resume,
train with checkpoints and validation, and end with a summary of what was written where.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dreamstep.engine.checkpoint import (
    load_checkpoint,
    read_checkpoint_extra,
    read_checkpoint_step,
    resolve_resume,
    save_checkpoint,
)
from dreamstep.engine.logging import TrainingLogger
from dreamstep.engine.loop import TrainingResult, run_training
from dreamstep.engine.train_step import TrainStep, make_accelerator
from dreamstep.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class Run:
    """One training run: its folder, accelerator, the checkpoint it resumes from (if any), and once
    training starts its logger. Nothing is written before :func:`fit`, so a setup error leaves no files."""

    output_dir: Path
    accelerator: Any
    resume_from: Path | None
    config_toml: str
    report_to: str
    tensorboard_dir: Path | None = None
    samples_dir: Path | None = None
    logger: TrainingLogger | None = None

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process


def claim_output_dir(output_dir: str | Path, *, overwrite: bool, resume_from_checkpoint: str | None) -> Path:
    """Refuse a non-empty ``--output_dir`` unless the run resumes from it or ``--overwrite_output_dir``."""
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output_dir {folder} is a file; give a folder")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite and not resume_from_checkpoint:
        raise UserError(f"--output_dir {folder} is not empty; pick a new folder, continue it with "
                        "--resume_from_checkpoint latest, or pass --overwrite_output_dir")
    return folder


def start_run(output_dir: str | Path, *, mixed_precision: str, seed: int, report_to: str,
              resume_from_checkpoint: str | None, config_toml: str, tensorboard_dir: str | Path | None = None,
              resume_must_match: tuple[str, ...] = (), samples_dir: str | Path | None = None) -> Run:
    """Set up the accelerator (devices, autocast, processes), seed everything and find the checkpoint to
    resume from, which must have been trained with the same ``resume_must_match`` settings (the flags that
    shape the trained weights); the folder, ``config.toml`` and the logs are written when training starts.
    TensorBoard event files go to ``tensorboard_dir`` (default: ``output_dir``), sample grids to
    ``samples_dir`` (default: ``output_dir/samples``)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        # accelerate keeps its state per process; a second run in one process (tests, notebooks) may
        # ask for another precision.
        AcceleratorState._reset_state()
    # Several processes without GPUs (accelerate launch on CPUs) need accelerate's CPU mode for gloo.
    cpu_processes = world_size > 1 and not torch.cuda.is_available()
    accelerator = make_accelerator(mixed_precision=mixed_precision, cpu=cpu_processes)
    if mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError("--mixed_precision fp16 needs a GPU (CPUs have no fp16 autocast); use bf16 or no")
    set_seed(seed)
    folder = Path(output_dir)
    resume_from = resolve_resume(folder, resume_from_checkpoint)
    if resume_from is not None:
        check_resume_settings(resume_from, config_toml, resume_must_match)
    return Run(folder, accelerator, resume_from, config_toml, report_to,
               Path(tensorboard_dir) if tensorboard_dir is not None else None,
               Path(samples_dir) if samples_dir is not None else None)


def check_resume_settings(checkpoint: Path, config_toml: str, keys: tuple[str, ...]) -> None:
    """Refuse to resume ``checkpoint`` when one of ``keys`` differs from the run that saved it (a
    different rank or set of target layers cannot load its weights), naming the flag and both values.
    The saved settings come from the checkpoint, or for older checkpoints from the run's config.toml."""
    saved_toml = read_checkpoint_extra(checkpoint).get("config")
    if saved_toml is None and (checkpoint.parent / "config.toml").is_file():
        saved_toml = (checkpoint.parent / "config.toml").read_text(encoding="utf-8")
    if saved_toml is None:
        return
    saved, current = tomllib.loads(saved_toml), tomllib.loads(config_toml)
    for key in keys:
        if saved.get(key) != current.get(key):
            was = _flag_value(saved.get(key))
            raise UserError(f"--{key} is {_flag_value(current.get(key))} but {checkpoint} was trained with {was}; "
                            f"resume with --{key} {was}, or start a new run in another --output_dir")


def _flag_value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(str(v) for v in value) or "(none)"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _open_output(run: Run) -> None:
    if run.is_main_process:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "config.toml").write_text(run.config_toml)
    run.accelerator.wait_for_everyone()
    # After a resume from step N, TensorBoard drops what the interrupted run logged after N.
    purge_step = read_checkpoint_step(run.resume_from) + 1 if run.resume_from is not None else None
    run.logger = TrainingLogger(run.output_dir, report_to=run.report_to, is_main_process=run.is_main_process,
                                tensorboard_dir=run.tensorboard_dir, samples_dir=run.samples_dir,
                                purge_step=purge_step)


def fit(run: Run, step: TrainStep, data: Any, *, max_train_steps: int | None, num_epochs: int | None,
        weights: Callable[[], Mapping[str, torch.Tensor]], load_weights: Callable[[Mapping[str, torch.Tensor]], None],
        checkpointing_steps: int, checkpoints_total_limit: int | None,
        validate: Callable[[int], list[Image.Image]] | None = None, validation_steps: int = 0,
        on_nonfinite_loss: str = "stop", checkpoint_due: Callable[[int], bool] | None = None) -> TrainingResult:
    """Resume if asked, then train for ``max_train_steps`` optimizer steps (when given, it overrides
    ``num_epochs``), saving ``checkpoint-N`` every ``checkpointing_steps`` and validation grids every
    ``validation_steps`` optimizer steps (0 turns either off). ``checkpoint_due(step)`` narrows the
    checkpoints to the steps it accepts; it must give the same answer on every process."""
    _open_output(run)
    resume = None
    if run.resume_from is not None:
        resume = load_checkpoint(run.resume_from, step)
        load_weights(resume.weights)
        # The loss curve of the whole run, not only of its resumed part.
        run.logger.history["loss"] = [tuple(pair) for pair in resume.extra.get("loss_history", [])]
        _say(run, f"resuming from {run.resume_from} (step {resume.position.global_step})")

    def save(position: Any) -> None:
        if checkpoint_due is not None and not checkpoint_due(position.global_step):
            return
        path = save_checkpoint(run.output_dir, step, position, weights(),
                               extra={"loss_history": run.logger.loss_history, "config": run.config_toml},
                               total_limit=checkpoints_total_limit)
        _say(run, f"saved {path}")

    def validate_and_log(global_step: int) -> None:
        # One process generates; the others wait (validation uses its own seeded generators, so the
        # training RNG of every process is untouched).
        if run.is_main_process:
            path = run.logger.log_images(global_step, validate(global_step))
            _say(run, f"validation images: {path}")
        run.accelerator.wait_for_everyone()

    return run_training(
        step, data, max_train_steps=max_train_steps, num_epochs=None if max_train_steps else num_epochs,
        resume=resume,
        checkpoint_every_n_steps=checkpointing_steps or None, save_checkpoint=save if checkpointing_steps else None,
        validate_every_n_steps=(validation_steps or None) if validate else None,
        validate=validate_and_log if validate else None, logger=run.logger,
        on_nonfinite_loss=on_nonfinite_loss, progress=run.is_main_process)


def finish(run: Run, written: Mapping[str, Path | None], validate_final: Callable[[], list[Image.Image]] | None = None,
           final_step: int = 0) -> None:
    """Final validation grid, loss curve, and the summary of every file written."""
    outputs = dict(written)
    if validate_final is not None and run.is_main_process:
        outputs["samples"] = run.logger.log_images(final_step, validate_final(), tag="final")
    outputs["loss curve"] = run.logger.close()
    tensorboard = run.report_to == "tensorboard" and run.logger.history
    outputs["TensorBoard logs"] = run.logger.tensorboard_dir if tensorboard else None
    run.accelerator.wait_for_everyone()
    if run.is_main_process:
        print("\nwrote:")
        for what, path in outputs.items():
            if path is not None:
                print(f"  {what:<18} {path}")


def _say(run: Run, message: str) -> None:
    if run.is_main_process:
        from tqdm.auto import tqdm

        tqdm.write(message)
