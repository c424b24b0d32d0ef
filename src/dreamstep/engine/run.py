"""What every trainer does around the loop: claim the output folder, set up devices and logging, resume,
train with checkpoints and validation, and end with a summary of what was written where.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dreamstep.engine.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from dreamstep.engine.logging import TrainingLogger
from dreamstep.engine.metrics import MetricsTable
from dreamstep.engine.loop import TrainingResult, run_training
from dreamstep.engine.train_step import TrainStep, make_accelerator
from dreamstep.errors import UserError


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
    logger: TrainingLogger | None = None
    started_at: float | None = None  # perf_counter when training started
    validation_seconds: float = 0.0  # wall time spent in validation (samples and scores)

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
              resume_from_checkpoint: str | None, config_toml: str, tensorboard_dir: str | Path | None = None) -> Run:
    """Set up the accelerator (devices, autocast, processes), seed everything and find the checkpoint to
    resume from; the folder, ``config.toml`` and the logs are written when training starts. TensorBoard
    event files go to ``tensorboard_dir`` (default: ``output_dir``)."""
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
    return Run(folder, accelerator, resolve_resume(folder, resume_from_checkpoint), config_toml, report_to,
               Path(tensorboard_dir) if tensorboard_dir is not None else None)


def _open_output(run: Run) -> None:
    if run.is_main_process:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "config.toml").write_text(run.config_toml)
    run.accelerator.wait_for_everyone()
    run.logger = TrainingLogger(run.output_dir, report_to=run.report_to, is_main_process=run.is_main_process,
                                tensorboard_dir=run.tensorboard_dir)


def fit(run: Run, step: TrainStep, data: Any, *, max_train_steps: int | None, num_epochs: int | None,
        weights: Callable[[], Mapping[str, torch.Tensor]], load_weights: Callable[[Mapping[str, torch.Tensor]], None],
        checkpointing_steps: int, checkpoints_total_limit: int | None,
        validate: Callable[[int], list[Image.Image]] | None = None, validation_steps: int = 0,
        on_nonfinite_loss: str = "stop", checkpoint_due: Callable[[int], bool] | None = None,
        validate_first: bool = False) -> TrainingResult:
    """Resume if asked, then train for ``max_train_steps`` optimizer steps (when given, it overrides
    ``num_epochs``), saving ``checkpoint-N`` every ``checkpointing_steps`` and validation grids every
    ``validation_steps`` optimizer steps (0 turns either off). ``checkpoint_due(step)`` narrows the
    checkpoints to the steps it accepts; it must give the same answer on every process.
    ``validate_first`` also validates the untrained model (step 0) of a run that does not resume: the
    baseline of its evaluation scores, which ``validate`` logs with ``run.logger.log_metrics``."""
    _open_output(run)
    resume = None
    if run.resume_from is not None:
        resume = load_checkpoint(run.resume_from, step)
        load_weights(resume.weights)
        # The loss curve and the scores of the whole run, not only of its resumed part.
        run.logger.history["loss"] = [tuple(pair) for pair in resume.extra.get("loss_history", [])]
        run.logger.metrics = MetricsTable.from_state(resume.extra.get("metrics", []))
        _say(run, f"resuming from {run.resume_from} (step {resume.position.global_step})")

    def save(position: Any) -> None:
        if checkpoint_due is not None and not checkpoint_due(position.global_step):
            return
        path = save_checkpoint(run.output_dir, step, position, weights(),
                               extra={"loss_history": run.logger.loss_history,
                                      "metrics": run.logger.metrics.state()},
                               total_limit=checkpoints_total_limit)
        _say(run, f"saved {path}")

    def validate_and_log(global_step: int) -> None:
        # One process generates; the others wait (validation uses its own seeded generators, so the
        # training RNG of every process is untouched).
        if run.is_main_process:
            start = time.perf_counter()
            path = run.logger.log_images(global_step, validate(global_step))
            run.validation_seconds += time.perf_counter() - start
            scores = run.logger.metrics.rows.get(global_step)
            if path is not None or scores:
                _say(run, f"validation at step {global_step}: " + ", ".join(
                    [f"{k} {v:.4g}" for k, v in (scores or {}).items()] + ([f"images {path}"] if path else [])))
        run.accelerator.wait_for_everyone()

    run.started_at = time.perf_counter()
    if validate_first and validate is not None and resume is None:
        validate_and_log(0)
    return run_training(
        step, data, max_train_steps=max_train_steps, num_epochs=None if max_train_steps else num_epochs,
        resume=resume,
        checkpoint_every_n_steps=checkpointing_steps or None, save_checkpoint=save if checkpointing_steps else None,
        validate_every_n_steps=(validation_steps or None) if validate else None,
        validate=validate_and_log if validate else None, logger=run.logger,
        on_nonfinite_loss=on_nonfinite_loss, progress=run.is_main_process)


def finish(run: Run, written: Mapping[str, Path | None], validate_final: Callable[[], list[Image.Image]] | None = None,
           final_step: int = 0, best_by: str | None = None,
           saved_at: Callable[[int], Path | None] | None = None) -> None:
    """Final validation grid, evaluation scores (``metrics.csv``, ``metrics.png``, the best step by
    ``best_by`` next to the final one), loss curve, and the summary of every file written.
    ``saved_at(step)`` names what was saved at a step (default: its ``checkpoint-N`` folder, if any)."""
    outputs = dict(written)
    if validate_final is not None and run.is_main_process:
        start = time.perf_counter()
        outputs["samples"] = run.logger.log_images(final_step, validate_final(), tag="final")
        run.validation_seconds += time.perf_counter() - start
    report = []
    if run.is_main_process and run.logger.metrics.rows:
        best = run.logger.metrics.best(best_by) if best_by else None
        outputs.update(run.logger.write_metrics(marks={best_by: best[0]} if best else None))
        report = evaluation_report(run, best_by, final_step, saved_at or _checkpoint_at(run.output_dir))
    outputs["loss curve"] = run.logger.close()
    tensorboard = run.report_to == "tensorboard" and run.logger.history
    outputs["TensorBoard logs"] = run.logger.tensorboard_dir if tensorboard else None
    run.accelerator.wait_for_everyone()
    if run.is_main_process:
        print("\nwrote:")
        for what, path in outputs.items():
            if path is not None:
                print(f"  {what:<18} {path}")
        for line in report:
            print(line)


def _checkpoint_at(output_dir: Path) -> Callable[[int], Path | None]:
    def find(step: int) -> Path | None:
        folder = output_dir / f"checkpoint-{step}"
        return folder if folder.is_dir() else None

    return find


def _scores(row: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {value:.4g}" for name, value in row.items())


def evaluation_report(run: Run, best_by: str | None, final_step: int,
                      saved_at: Callable[[int], Path | None]) -> list[str]:
    """Lines naming the best step by ``best_by`` and its scores next to the final step's, and what
    validation cost as a share of the run's wall time."""
    table = run.logger.metrics
    lines = ["", "evaluation:"]
    best = table.best(best_by) if best_by else None
    if best is not None:
        step, row = best
        where = saved_at(step) or (run.output_dir if step == final_step else None)
        kept = f" -> {where}" if where is not None else " (nothing was saved at that step; align the " \
                                                          "checkpoint/save cadence with the validation steps)"
        lines.append(f"  best by {best_by}: step {step}: {_scores(row)}{kept}")
    if final_step in table.rows:
        lines.append(f"  final: step {final_step}: {_scores(table.rows[final_step])}")
    if run.started_at is not None:
        total = time.perf_counter() - run.started_at
        lines.append(f"  validation (samples and scores) took {run.validation_seconds:.1f} s of the run's "
                     f"{total:.1f} s ({100 * run.validation_seconds / max(total, 1e-9):.1f}%)")
    return lines


def _say(run: Run, message: str) -> None:
    if run.is_main_process:
        from tqdm.auto import tqdm

        tqdm.write(message)
