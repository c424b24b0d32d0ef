"""What every trainer does around the loop: claim the output folder, set up devices and logging, resume,
train with checkpoints and validation, and end with a summary of what was written where.

While it runs, a run owns its folder (``dreamstep.engine.run_folder``: a lock, and ``run_status.json`` for
the dashboard). Ctrl-C or SIGTERM during training finish the step, save a checkpoint and print the command
that continues (``dreamstep.engine.interrupt``); a full disk stops the run before a save that cannot fit
(``dreamstep.engine.disk``); ``--resume_from_checkpoint latest`` falls back to the newest checkpoint that
loads. Whatever ends the run, its status says how, and the lock is released.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dreamstep.engine.checkpoint import (
    DamagedCheckpointError,
    LoadedCheckpoint,
    broadcast_from_main,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_extra,
    read_checkpoint_step,
    resolve_resume,
    save_checkpoint,
)
from dreamstep.engine.disk import DiskFullError, disk_full_message, is_disk_full
from dreamstep.engine.interrupt import RunInterrupted, StopSignals
from dreamstep.engine.logging import TrainingLogger, log_time
from dreamstep.engine.loop import TrainingPosition, TrainingResult, run_training
from dreamstep.engine.metrics import MetricsTable
from dreamstep.engine.run_folder import STATUS_FILE, OutputLock, RunStatus, check_output_dir, write_text_atomically
from dreamstep.engine.train_step import TrainStep, make_accelerator
from dreamstep.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class Run:
    """One training run: its folder, accelerator, the checkpoint it resumes from (if any), and once
    training starts its logger. Until :func:`fit` only the lock and ``run_status.json`` are written, so a
    setup error leaves a folder the same command accepts again."""

    output_dir: Path
    accelerator: Any
    resume_from: Path | None
    config_toml: str
    report_to: str
    tensorboard_dir: Path | None = None
    samples_dir: Path | None = None
    logger: TrainingLogger | None = None
    resume_request: str | None = None  # what the user asked for, e.g. "latest"
    resume_command: str = ""  # the command that continues this run from its newest checkpoint
    status: RunStatus = field(default_factory=lambda: RunStatus(None))
    signals: StopSignals = field(default_factory=StopSignals)
    result: TrainingResult | None = None
    lock: OutputLock | None = None
    created_folder: bool = False  # this run made --output_dir; a failure before training removes it again
    started_at: float | None = None  # perf_counter when training started
    validation_seconds: float = 0.0  # wall time spent in validation (samples and scores)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    def close(self, state: str, message: str | None = None) -> None:
        """Record how the run ended, release the folder and the signal handlers (once; later calls do nothing)."""
        global _open_run
        if self.status.fields["state"] == "running":
            self.status.update(state=state, message=message)
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if state == "failed" and self.created_folder and self.logger is None:
            # Nothing was trained or written but the status: leave no folder behind a bad input.
            (self.output_dir / STATUS_FILE).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.output_dir.rmdir()
        self.signals.uninstall()
        atexit.unregister(self._close_at_exit)
        if _open_run is self:
            _open_run = None

    def _close_at_exit(self) -> None:
        """The process ends without :func:`finish`: an error or a signal outside the loop."""
        self.close("interrupted" if self.signals.received else "failed", "the run ended before it finished")


_open_run: Run | None = None  # runs in one process follow each other; an unfinished one is over when the next starts


def end_unfinished_run(message: str) -> None:
    """Close the run that an error or a later run's start ended, so its folder is released at once."""
    if _open_run is not None:
        _open_run.close("interrupted" if _open_run.signals.received else "failed", message)


def claim_output_dir(output_dir: str | Path, *, overwrite: bool, resume_from_checkpoint: str | None,
                     resume_flag: str = "--resume_from_checkpoint", config_toml: str = "",
                     resume_must_match: tuple[str, ...] = ()) -> Path:
    """Refuse an ``--output_dir`` this run must not write into (see ``dreamstep.engine.run_folder``):
    another live run's, or one holding files a fresh run would overwrite; and a checkpoint to resume that
    was trained with other ``resume_must_match`` settings (the flags that shape the trained weights) than
    ``config_toml``'s. Writes nothing."""
    end_unfinished_run("a later run in the same process started")
    resume = resolve_resume(output_dir, resume_from_checkpoint, resume_flag)
    if resume is not None:
        check_resume_settings(resume, config_toml, resume_must_match)
    return check_output_dir(output_dir, overwrite=overwrite, resume=resume, resume_request=resume_from_checkpoint,
                            resume_flag=resume_flag)


def start_run(output_dir: str | Path, *, mixed_precision: str, seed: int, report_to: str,
              resume_from_checkpoint: str | None, config_toml: str, tensorboard_dir: str | Path | None = None,
              command: str = "dreamstep train", resume_flag: str = "--resume_from_checkpoint",
              overwrite: bool = False, samples_dir: str | Path | None = None) -> Run:
    """Set up the accelerator (devices, autocast, processes), seed everything, find the checkpoint to
    resume from (checked by :func:`claim_output_dir`), and take the output folder: its lock and ``run_status.json`` (main
    process). ``config.toml`` and the logs are written when training starts. TensorBoard event files go to
    ``tensorboard_dir`` (default: ``output_dir``), sample grids to ``samples_dir`` (default:
    ``output_dir/samples``). ``command`` (e.g. ``dreamstep train flux-lora``) and ``resume_flag`` make
    the command printed to continue an interrupted run."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    end_unfinished_run("a later run in the same process started")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        # accelerate keeps its state per process; a second run in one process (tests, notebooks) may
        # ask for another precision.
        AcceleratorState._reset_state()
    # Several processes without GPUs (accelerate launch on CPUs) need accelerate's CPU mode for gloo.
    cpu_processes = world_size > 1 and not torch.cuda.is_available()
    accelerator = make_accelerator(mixed_precision=mixed_precision, cpu=cpu_processes)
    if accelerator.distributed_type == "DEEPSPEED":
        raise UserError("accelerate launch --use_deepspeed: DeepSpeed would take over accumulation, loss scaling and "
                        "clipping from dreamstep's engine; launch without it (DDP), or shard with --zero_stage 2|3 "
                        "(flux-controlnet)")
    if mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError("--mixed_precision fp16 needs a GPU (CPUs have no fp16 autocast); use bf16 or no")
    set_seed(seed)
    folder = Path(output_dir)
    resume_from = resolve_resume(folder, resume_from_checkpoint, resume_flag)
    run = Run(folder, accelerator, resume_from, config_toml, report_to,
              Path(tensorboard_dir) if tensorboard_dir is not None else None,
              Path(samples_dir) if samples_dir is not None else None, resume_request=resume_from_checkpoint,
              resume_command=_resume_command(command, folder, resume_flag, accelerator.num_processes))
    refusal = None
    if run.is_main_process:
        try:
            _take_folder(run, overwrite, resume_flag)
        except UserError as e:
            refusal = str(e)
    refusal = broadcast_from_main(refusal, accelerator)
    if refusal is not None:
        raise UserError(refusal)
    global _open_run
    _open_run = run
    run.signals.hint = "nothing was trained yet; run the same command again to start over"
    run.signals.install()
    if resume_from_checkpoint and run.resume_from is None:
        _say(run, f"note: {folder} has no checkpoint yet, so this is a fresh run")
    return run


def check_resume_settings(checkpoint: Path, config_toml: str, keys: tuple[str, ...]) -> None:
    """Refuse to resume ``checkpoint`` when one of ``keys`` differs from the run that saved it (a
    different rank or set of target layers cannot load its weights), naming the flag and both values.
    The saved settings come from the checkpoint, or for older checkpoints from the run's config.toml.
    A damaged checkpoint is left to the resume, which names the file (or, with latest, skips it)."""
    try:
        saved_toml = read_checkpoint_extra(checkpoint).get("config")
    except DamagedCheckpointError:
        return
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


def _take_folder(run: Run, overwrite: bool, resume_flag: str) -> None:
    """Check the folder again under its lock (another run may have started since the first check)."""
    run.created_folder = not run.output_dir.exists()
    run.output_dir.mkdir(parents=True, exist_ok=True)
    run.lock, previous = OutputLock.acquire(run.output_dir, run.resume_command)
    try:
        check_output_dir(run.output_dir, overwrite=overwrite, resume=run.resume_from,
                         resume_request=run.resume_request, resume_flag=resume_flag, check_lock=False)
    except UserError:
        run.lock.release()
        raise
    if previous is not None:
        _say(run, f"note: took over the lock of process {previous.get('pid')}, which ended without releasing it")
    run.status = RunStatus(run.output_dir)
    run.status.update()
    atexit.register(run._close_at_exit)


def _resume_command(command: str, folder: Path, resume_flag: str, num_processes: int) -> str:
    """The resolved settings are saved in ``config.toml``, so this continues the run exactly (a random
    seed included), whatever the original command line was."""
    if num_processes > 1:
        command = f"accelerate launch --multi_gpu --num_processes {num_processes} -m {command}"
    return f"{command} --config {shlex.quote(str(folder / 'config.toml'))} {resume_flag} latest"


def _open_output(run: Run) -> None:
    if run.is_main_process:
        try:
            write_text_atomically(run.output_dir / "config.toml", run.config_toml)
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


def fit(run: Run, step: TrainStep, data: Any, *, max_train_steps: int | None, num_epochs: int | None,
        weights: Callable[[], Mapping[str, torch.Tensor]], load_weights: Callable[[Mapping[str, torch.Tensor]], None],
        checkpointing_steps: int, checkpoints_total_limit: int | None,
        validate: Callable[[int], list[Image.Image]] | None = None, validation_steps: int = 0,
        on_nonfinite_loss: str = "stop", max_skipped_steps_fraction: float = 1.0,
        checkpoint_due: Callable[[int], bool] | None = None, validate_first: bool = False,
        validate_on_every_process: bool = False) -> TrainingResult:
    """Resume if asked, then train for ``max_train_steps`` optimizer steps (when given, it overrides
    ``num_epochs``), saving ``checkpoint-N`` every ``checkpointing_steps`` and validation grids every
    ``validation_steps`` optimizer steps (0 turns either off). ``checkpoint_due(step)`` narrows the
    checkpoints to the steps it accepts; it must give the same answer on every process.
    ``validate_first`` also validates the untrained model (step 0) of a run that does not resume: the
    baseline of its evaluation scores, which ``validate`` logs with ``run.logger.log_metrics``. A sharded
    model can only run forward on all processes at once: ``validate_on_every_process`` then has every
    process generate (the main one saves). A signal ends the run after the current step with a checkpoint
    (:class:`RunInterrupted`); any error marks it failed."""
    run.signals.hint = ""  # an abort in the loop gets the checkpoint hint from _interrupted
    try:
        _open_output(run)
        resume = _resume(run, step, load_weights)
        saved_at = {resume.position.global_step} if resume is not None else set()

        def save(position: TrainingPosition, always: bool = False) -> None:
            if not always and checkpoint_due is not None and not checkpoint_due(position.global_step):
                return
            path = save_checkpoint(run.output_dir, step, position, weights(),
                                   extra={"loss_history": run.logger.loss_history, "config": run.config_toml,
                                          "metrics": run.logger.metrics.state()},
                                   total_limit=checkpoints_total_limit)
            saved_at.add(position.global_step)
            run.status.update(checkpoint=path.name)
            _say(run, f"saved {path}")

        def validate_and_log(global_step: int) -> None:
            # One process generates (all, for a sharded model); the others wait. Validation uses its own seeded
            # generators, so the training RNG of every process is untouched.
            images = None
            if run.is_main_process or validate_on_every_process:
                start = time.perf_counter()
                images = validate(global_step)
                run.validation_seconds += time.perf_counter() - start
            if run.is_main_process:
                path = run.logger.log_images(global_step, images)
                scores = run.logger.metrics.rows.get(global_step)
                if path is not None or scores:
                    _say(run, f"validation at step {global_step}: " + ", ".join(
                        [f"{k} {v:.4g}" for k, v in (scores or {}).items()] + ([f"images {path}"] if path else [])))
            run.accelerator.wait_for_everyone()

        def step_done(position: TrainingPosition, loss: float, total_steps: int) -> bool:
            run.status.update(step=position.global_step, total_steps=total_steps, loss=loss)
            return run.signals.stop_requested()

        run.started_at = time.perf_counter()
        run.signals.graceful = True
        try:
            if validate_first and validate is not None and resume is None:
                validate_and_log(0)
            result = run_training(
                step, data, max_train_steps=max_train_steps, num_epochs=None if max_train_steps else num_epochs,
                resume=resume, checkpoint_every_n_steps=checkpointing_steps or None,
                save_checkpoint=save if checkpointing_steps else None,
                validate_every_n_steps=(validation_steps or None) if validate else None,
                validate=validate_and_log if validate else None, logger=run.logger,
                on_nonfinite_loss=on_nonfinite_loss, max_skipped_fraction=max_skipped_steps_fraction,
                on_step=step_done, progress=run.is_main_process)
        finally:
            run.signals.graceful = False
        run.result = result
        if result.stopped:
            if result.position.global_step not in saved_at:
                save(result.position, always=True)
            raise RunInterrupted(f"stopped by {run.signals.received.name} at step {result.position.global_step}",
                                 run.signals.exit_code)
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


def _resume(run: Run, step: TrainStep, load_weights: Callable[[Mapping[str, torch.Tensor]], None]
            ) -> LoadedCheckpoint | None:
    """Load the checkpoint to resume; with ``latest``, a damaged one gives way to the newest that loads."""
    if run.resume_from is None:
        return None
    candidates = [run.resume_from]
    if run.resume_request == "latest":
        candidates = [p for p in reversed(list_checkpoints(run.output_dir))]
    damaged = []
    for path in candidates:
        try:
            resume = load_checkpoint(path, step)
        except DamagedCheckpointError as e:
            if run.resume_request != "latest":
                raise
            damaged.append(path.name)
            _say(run, f"warning: {e}")
            continue
        if damaged:
            _say(run, f"warning: {', '.join(damaged)} cannot be read; resuming from {path.name}, the newest "
                      "checkpoint that loads")
        load_weights(resume.weights)
        # The loss curve and the scores of the whole run, not only of its resumed part.
        run.logger.history["loss"] = [tuple(pair) for pair in resume.extra.get("loss_history", [])]
        run.logger.metrics = MetricsTable.from_state(resume.extra.get("metrics", []))
        run.status.update(step=resume.position.global_step, checkpoint=path.name)
        _say(run, f"resuming from {path} (step {resume.position.global_step})")
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
    run.close("interrupted", message)
    return RunInterrupted(message, getattr(error, "exit_code", run.signals.exit_code))


def finish(run: Run, written: Mapping[str, Path | None], validate_final: Callable[[], list[Image.Image]] | None = None,
           final_step: int = 0, best_by: str | None = None,
           saved_at: Callable[[int], Path | None] | None = None, validate_on_every_process: bool = False) -> None:
    """Final validation grid, evaluation scores (``metrics.csv``, ``metrics.png``, the best step by
    ``best_by`` next to the final one), loss curve, and the summary of every file written.
    ``saved_at(step)`` names what was saved at a step (default: its ``checkpoint-N`` folder, if any).
    The run is then marked finished."""
    outputs = dict(written)
    if validate_final is not None and (run.is_main_process or validate_on_every_process):
        start = time.perf_counter()
        images = validate_final()
        run.validation_seconds += time.perf_counter() - start
        if run.is_main_process:
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
    skipped = run.result.nonfinite_steps if run.result is not None else []
    if run.is_main_process:
        lines = [f"  {what:<18} {path}" for what, path in outputs.items() if path is not None] + list(report)
        if skipped:
            print(f"\nnote: {len(skipped)} of {run.result.total_steps} steps were skipped because the loss was "
                  f"not finite (steps {', '.join(map(str, skipped[:8]))}{' ...' if len(skipped) > 8 else ''})")
        print("\nwrote:\n" + "\n".join(lines))
        with open(run.output_dir / "train.log", "a", encoding="utf-8") as log:
            log.write(f"{log_time()} finished; wrote:\n" + "\n".join(lines) + "\n")
    run.close("finished", f"{len(skipped)} steps skipped (non-finite loss)" if skipped else None)


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
        if run.logger is not None:
            run.logger.note(message)
