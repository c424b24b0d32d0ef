"""What every trainer does from its first step to its summary: resume if asked, train with its hooks (sample,
save, checkpoint), and end with a summary of what was written where.

A signal during training finishes the step, saves a checkpoint and ends the run with the command that
continues it (:class:`~dreamstep.engine.interrupt.RunInterrupted`); a full disk stops it before a save that
cannot fit; ``--resume_from_checkpoint latest`` falls back to the newest checkpoint that loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from dreamstep.engine.checkpoint import (
    DamagedCheckpointError,
    LoadedCheckpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_step,
    save_checkpoint,
)
from dreamstep.engine.disk import DiskFullError, disk_full_message, is_disk_full
from dreamstep.engine.interrupt import GRACEFUL, RunInterrupted
from dreamstep.engine.logging import TrainingLogger, log_time
from dreamstep.engine.loop import AnyOf, Every, Hook, TrainingPosition, TrainingResult, run_training
from dreamstep.engine.metrics import MetricsTable
from dreamstep.engine.run import Run, say_and_log
from dreamstep.engine.run_folder import SAMPLE_REQUEST
from dreamstep.engine.train_step import TrainStep
from dreamstep.errors import UserError
from dreamstep.files import write_text_atomic


@dataclass
class RunHooks:
    """What a run does besides training, each on its own cadence; at a step where several are due they run
    in this order. A validation point: ``sample(global_step)`` gives images from the model as it trains,
    logged as a grid, then ``score(global_step, images)`` gives the evaluation scores of that point (its
    samples, a validation loss), logged and reported with them (a step scored before a resume is not scored
    again). Both run on the main process (on every process with ``sample_on_every_process``, for a sharded
    model that runs forward only on all at once). Samples are due at ``sample_every``, scores at
    ``score_every`` (default: with the samples); ``sample_first`` validates the untrained model too (step 0 of
    a run that does not resume: the baseline of the scores). At the end, :func:`finish` validates once more,
    with ``sample_final`` instead of ``sample`` when given. ``save(global_step)``: write the trained weights
    (main process), not at the last step, whose weights the recipe writes itself. Checkpoints (every process):
    ``checkpoint-N`` folders, at most ``checkpoints_total_limit`` of them, and with ``checkpoint_at_end`` one at
    the last step too. ``validation_weights()``: the weights a validation point runs with (e.g. the EMA's,
    :meth:`~dreamstep.engine.ema.WeightAverage.swapped_in`), the trained ones again after it."""

    sample: Callable[[int], list[Image.Image]] | None = None
    score: Callable[[int, list[Image.Image]], Mapping[str, float]] | None = None
    sample_every: Every | AnyOf = field(default_factory=Every)
    score_every: Every | AnyOf | None = None
    sample_first: bool = False
    sample_final: Callable[[int], list[Image.Image]] | None = None
    sample_on_every_process: bool = False
    save: Callable[[int], Path] | None = None
    save_every: Every = field(default_factory=Every)
    checkpoint_every: Every = field(default_factory=Every)
    checkpoints_total_limit: int | None = None
    checkpoint_at_end: bool = False
    validation_weights: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext


@dataclass
class FinishedRun:
    """What a trainer returns: every file it wrote (by what it is), and the loop's result."""

    written: dict[str, Path | None]
    result: TrainingResult


def fit(run: Run, step: TrainStep, data: Any, *, total_steps: int, trained: Any, hooks: RunHooks | None = None,
        on_nonfinite_loss: str = "stop", max_skipped_steps_fraction: float = 1.0,
        logging_steps: int = 1) -> TrainingResult:
    """Resume if asked, then train for ``total_steps`` optimizer steps, running ``hooks`` when due.
    ``trained`` is what the run trains and checkpoints (its ``state_dict`` and ``load_state_dict``).
    The loss is read from the device every ``logging_steps`` steps (see :func:`run_training`'s
    ``log_every``), and the run's status file is rewritten then.
    A signal ends the run after the current step with a checkpoint (:class:`RunInterrupted`); any error
    marks it failed."""
    hooks = hooks or RunHooks()
    run.signals.hint = ""  # an abort in the loop gets the checkpoint hint from _interrupted
    try:
        _open_output(run)
        resume = _resume(run, step, trained)
        checkpointed = {resume.position.global_step} if resume is not None else set()

        def checkpoint(position: TrainingPosition) -> None:
            path = save_checkpoint(run.output_dir, step, position, trained.state_dict(),
                                   extra={"loss_history": run.logger.loss_history, "config": run.config_toml,
                                          "metrics": run.logger.metrics.state()},
                                   total_limit=hooks.checkpoints_total_limit)
            checkpointed.add(position.global_step)
            run.status.update(checkpoint=path.name)
            say_and_log(run, f"saved {path}")

        def validate(position: TrainingPosition) -> None:
            images, _ = _validation_point(run, hooks, position.global_step, hooks.sample, cadence.samples_due,
                                          cadence.scores_due)
            if run.is_main_process:
                path = run.logger.log_images(position.global_step, images)
                scores = run.logger.metrics.rows.get(position.global_step)
                if path is not None or scores:
                    say_and_log(run, f"validation at step {position.global_step}: " + ", ".join(
                        [f"{k} {v:.4g}" for k, v in (scores or {}).items()] + ([f"images {path}"] if path else [])))
            run.accelerator.wait_for_everyone()
            if run.is_main_process and cadence.request is not None:
                cadence.request.unlink(missing_ok=True)

        def save(position: TrainingPosition) -> None:
            if run.is_main_process and position.global_step < total_steps:
                say_and_log(run, f"saved {hooks.save(position.global_step)}")

        def step_done(position: TrainingPosition, loss: float | None, planned: int) -> bool:
            stop = run.signals.stop_requested()
            if loss is not None or stop:
                run.status.update(step=position.global_step, total_steps=planned,
                                  **({"loss": loss} if loss is not None else {}))
            return stop

        cadence = _ValidationCadence(hooks.sample_every, hooks.score_every or hooks.sample_every,
                                     run.output_dir / SAMPLE_REQUEST if hooks.sample is not None else None)
        scheduled = [Hook(cadence, validate)] if hooks.sample is not None or hooks.score is not None else []
        scheduled += [Hook(hooks.save_every, save)] if hooks.save is not None else []
        scheduled.append(Hook(hooks.checkpoint_every, checkpoint))
        run.started_at = time.perf_counter()
        run.signals.waiting = GRACEFUL
        try:
            if hooks.sample_first and scheduled and resume is None:
                cadence.samples_due = cadence.scores_due = True
                validate(TrainingPosition())
            result = run_training(step, data, max_train_steps=total_steps, resume=resume, hooks=scheduled,
                                  logger=run.logger, on_nonfinite_loss=on_nonfinite_loss,
                                  max_skipped_fraction=max_skipped_steps_fraction, on_step=step_done,
                                  progress=run.is_main_process, log_every=logging_steps)
        finally:
            run.signals.waiting = None
        run.result = result
        position = result.position
        if result.stopped:
            if position.global_step not in checkpointed:
                checkpoint(dataclasses.replace(position))
            raise RunInterrupted(f"stopped by {run.signals.received.name} at step {position.global_step}",
                                 run.signals.exit_code)
        if hooks.checkpoint_at_end and result.losses and position.global_step not in checkpointed:
            checkpoint(dataclasses.replace(position))
        run.signals.hint = _continue_hint(run)
        return result
    except KeyboardInterrupt as e:
        raise _interrupted(run, e) from None
    except DiskFullError as e:
        run.close("failed", str(e))
        again = f": {run.resume_command}" if list_checkpoints(run.output_dir) else " with the same command"
        raise DiskFullError(f"{e}{again}") from None
    except BaseException as e:
        run.close("failed", str(e) or type(e).__name__)
        raise


def hooks_from_options(config: Any, *, sample: Callable[[int], list[Image.Image]] | None,
                       score: Callable[[int, list[Image.Image]], Mapping[str, float]] | None, ema: Any | None,
                       **more: Any) -> RunHooks:
    """The hooks the trainers set from their shared options: a validation point every ``validation_steps`` (and
    one before training when there are scores, their baseline), a checkpoint every ``checkpointing_steps``
    keeping ``checkpoints_total_limit``, validating with the EMA's weights under ``ema_validation``; ``more``:
    any other :class:`RunHooks` field."""
    from dreamstep.engine.ema import validation_weights  # diffusers' EMA: imported by the trainers that run

    return RunHooks(sample=sample, score=score, sample_every=Every(config.validation_steps or None),
                    sample_first=score is not None, checkpoint_every=Every(config.checkpointing_steps or None),
                    checkpoints_total_limit=config.checkpoints_total_limit,
                    validation_weights=validation_weights(ema, config.ema_validation), **more)


def fit_from_options(run: Run, step: TrainStep, data: Any, config: Any, *, total_steps: int, trained: Any,
                     ema: Any | None, hooks: RunHooks) -> TrainingResult:
    """:func:`fit` with the trainers' shared options (``on_nonfinite_loss``, ``max_skipped_steps_fraction``,
    ``logging_steps``), training ``trained`` and checkpointing it with its EMA."""
    from dreamstep.engine.ema import with_average

    return fit(run, step, data, total_steps=total_steps, trained=with_average(trained, ema), hooks=hooks,
               on_nonfinite_loss=config.on_nonfinite_loss,
               max_skipped_steps_fraction=config.max_skipped_steps_fraction, logging_steps=config.logging_steps)


def _open_output(run: Run) -> None:
    if run.is_main_process:
        try:
            write_text_atomic(run.output_dir / "config.toml", run.config_toml)
        except OSError as e:
            if not is_disk_full(e):
                raise
            raise DiskFullError(disk_full_message(run.output_dir, len(run.config_toml), "config.toml",
                                                  "nothing was trained yet")) from None
    run.accelerator.wait_for_everyone()
    # After a resume from step N, TensorBoard drops what the interrupted run logged after N.
    try:
        purge_step = read_checkpoint_step(run.resume_from) + 1 if run.resume_from is not None else None
    except DamagedCheckpointError:
        purge_step = None  # the resume names the file, or falls back to an older checkpoint
    run.logger = TrainingLogger(run.output_dir, report_to=run.report_to, is_main_process=run.is_main_process,
                                tensorboard_dir=run.tensorboard_dir, samples_dir=run.samples_dir,
                                purge_step=purge_step)
    for text in run.preamble:  # the run summary and the notes said while loading
        for line in text.splitlines():
            run.logger.note(line)


def _resume(run: Run, step: TrainStep, trained: Any) -> LoadedCheckpoint | None:
    """Load the checkpoint to resume (``start_run`` found it readable); with ``latest``, one that still fails
    to load gives way to the newest older one that loads."""
    if run.resume_from is None:
        return None
    candidates = [run.resume_from]
    if run.resume_request == "latest":
        names = [p.name for p in list_checkpoints(run.output_dir)]
        older = names[:names.index(run.resume_from.name)] if run.resume_from.name in names else []
        candidates += [run.output_dir / name for name in reversed(older)]
    damaged = []
    for path in candidates:
        try:
            resume = load_checkpoint(path, step)
        except DamagedCheckpointError as e:
            if run.resume_request != "latest":
                raise
            damaged.append(path.name)
            say_and_log(run, f"warning: {e}")
            continue
        if damaged:
            say_and_log(run, f"warning: {', '.join(damaged)} cannot be read; resuming from {path.name}, the newest "
                             "checkpoint that loads")
        trained.load_state_dict(resume.weights)
        # The loss curve and the scores of the whole run, not only of its resumed part.
        run.logger.history["loss"] = [tuple(pair) for pair in resume.extra.get("loss_history", [])]
        run.logger.metrics = MetricsTable.from_state(resume.extra.get("metrics", []))
        run.status.update(step=resume.position.global_step, checkpoint=path.name)
        say_and_log(run, f"resuming from {path} (step {resume.position.global_step})")
        return resume
    raise UserError(f"no checkpoint in {run.output_dir} can be read ({', '.join(damaged)} are damaged); "
                    "start a new run in a new --output_dir")


def _continue_hint(run: Run) -> str:
    checkpoints = list_checkpoints(run.output_dir)
    if not checkpoints:
        return "no checkpoint was written; run the same command again to start over"
    return f"the last checkpoint is {checkpoints[-1]}; continue with:\n  {run.resume_command}"


def _interrupted(run: Run, error: KeyboardInterrupt) -> RunInterrupted:
    """The message and exit code of a run that a signal ended, and its status."""
    what = str(error) or "stopped by SIGINT"
    message = f"{what}; {_continue_hint(run)}"
    if run.logger is not None:
        run.logger.note(message)
    run.close("interrupted", message)
    return RunInterrupted(message, getattr(error, "exit_code", run.signals.exit_code))


@dataclass
class _ValidationCadence:
    """Due when samples or scores are, remembering which (for the hook that then runs)."""

    sample_every: Every | AnyOf
    score_every: Every | AnyOf
    request: Path | None = None  # a file whose presence asks for samples at the next step ("sample now")
    samples_due: bool = False
    scores_due: bool = False

    def due(self, global_step: int, steps_per_epoch: int) -> bool:
        requested = self.request is not None and self.request.exists()
        self.samples_due = requested or self.sample_every.due(global_step, steps_per_epoch)
        self.scores_due = self.score_every.due(global_step, steps_per_epoch)
        return self.samples_due or self.scores_due


def _validation_point(run: Run, hooks: RunHooks, global_step: int,
                      sample: Callable[[int], list[Image.Image]] | None, samples: bool,
                      scores: bool) -> tuple[list[Image.Image] | None, Mapping[str, float]]:
    """The samples and scores of a validation point on the processes that take part (``None`` and nothing on
    the others), the scores logged, the wall time added to the run's. One process generates (all, for a
    sharded model); the others wait. Sampling uses its own seeded generators, so the training RNG of every
    process is untouched."""
    if not (run.is_main_process or hooks.sample_on_every_process):
        return None, {}
    start = time.perf_counter()
    found: Mapping[str, float] = {}
    with hooks.validation_weights():
        images = sample(global_step) if samples and sample is not None else []
        if scores and hooks.score is not None and global_step not in run.logger.metrics.rows:
            found = hooks.score(global_step, images)
    if found:
        run.logger.log_metrics(global_step, found)
    run.validation_seconds += time.perf_counter() - start
    return images, found


def finish(run: Run, written: Mapping[str, Path | None], result: TrainingResult, hooks: RunHooks | None = None,
           *, best_by: str | None = None, saved_at: Callable[[int], Path | None] | None = None) -> FinishedRun:
    """Final validation (``hooks.sample_final`` or ``hooks.sample`` and ``hooks.score`` at the last step; the
    samples' grid tagged final), evaluation scores (``metrics.csv``, ``metrics.png``, the best step by
    ``best_by`` next to the final one), loss curve, and the summary of every file written. ``saved_at(step)``
    names what was saved at a step (default: its ``checkpoint-N`` folder, if any). The run is then marked
    finished."""
    outputs = dict(written)
    final_step = result.position.global_step
    hooks = hooks or RunHooks()
    if hooks.sample is not None or hooks.score is not None:
        images, _ = _validation_point(run, hooks, final_step, hooks.sample_final or hooks.sample, True, True)
        if run.is_main_process and images:
            outputs["samples"] = run.logger.log_images(final_step, images, tag="final")
    report = []
    if run.is_main_process and run.logger.metrics.rows:
        best = run.logger.metrics.best(best_by) if best_by else None
        outputs.update(run.logger.write_metrics(marks={best_by: best[0]} if best else None))
        report = evaluation_report(run, best_by, final_step, saved_at or _checkpoint_at(run.output_dir))
    outputs["loss curve"] = run.logger.close()
    tensorboard = run.report_to == "tensorboard" and run.logger.history
    outputs["TensorBoard logs"] = run.logger.tensorboard_dir if tensorboard else None
    run.accelerator.wait_for_everyone()
    skipped = result.nonfinite_steps
    if run.is_main_process:
        lines = [f"  {what:<18} {path}" for what, path in outputs.items() if path is not None] + list(report)
        if skipped:
            print(f"\nnote: {len(skipped)} of {result.total_steps} steps were skipped because the loss was "
                  f"not finite (steps {', '.join(map(str, skipped[:8]))}{' ...' if len(skipped) > 8 else ''})")
        print("\nwrote:\n" + "\n".join(lines))
        with open(run.output_dir / "train.log", "a", encoding="utf-8") as log:
            log.write(f"{log_time()} finished; wrote:\n" + "\n".join(lines) + "\n")
    run.close("finished", f"{len(skipped)} steps skipped (non-finite loss)" if skipped else None)
    return FinishedRun(outputs, result)


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
