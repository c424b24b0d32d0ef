"""A training run's life around the loop: claim the output folder, set up devices, find the checkpoint to
resume from, and release the folder however the run ends. Training itself, its hooks and the closing
summary are :mod:`dreamstep.engine.fit`.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dreamstep.command_end import when_a_command_fails
from dreamstep.engine.checkpoint import (
    DamagedCheckpointError,
    broadcast_from_main,
    read_checkpoint_extra,
    remove_leftovers,
    resume_candidates,
)
from dreamstep.engine.interrupt import StopSignals
from dreamstep.engine.logging import TrainingLogger, say, take_said_before_the_run
from dreamstep.engine.loop import TrainingResult
from dreamstep.engine.run_folder import STATUS_FILE, OutputLock, RunStatus, check_output_dir
from dreamstep.engine.train_step import make_accelerator
from dreamstep.errors import UserError
from dreamstep.files import write_bytes_atomic

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
    previous_status: bytes | None = None  # run_status.json as it was; a failure before training puts it back
    started_at: float | None = None  # perf_counter when training started
    validation_seconds: float = 0.0  # wall time spent in validation (samples and scores)
    preamble: list[str] = field(default_factory=list)  # said before train.log opened; written there first

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
        if state == "failed" and self.logger is None and self.status.path is not None:
            # Nothing was trained or written but the status: leave the folder as it was (none, if it was none).
            self._restore_status()
            if self.created_folder:
                with contextlib.suppress(OSError):
                    self.output_dir.rmdir()
        self.signals.uninstall()
        atexit.unregister(self._close_at_exit)
        if _open_run is self:
            _open_run = None

    def _restore_status(self) -> None:
        if self.previous_status is None:
            self.status.path.unlink(missing_ok=True)
        else:
            write_bytes_atomic(self.status.path, self.previous_status)

    def _close_at_exit(self) -> None:
        """The process ends without :func:`finish`: an error or a signal outside the loop."""
        self.close("interrupted" if self.signals.received else "failed", "the run ended before it finished")


_open_run: Run | None = None  # runs in one process follow each other; an unfinished one is over when the next starts


def end_unfinished_run(message: str) -> None:
    """Close the run that an error or a later run's start ended, so its folder is released at once."""
    if _open_run is not None:
        _open_run.close("interrupted" if _open_run.signals.received else "failed", message)


when_a_command_fails(end_unfinished_run)


# The checkpoint that claim_output_dir chose (read and found readable) and its warnings, for the start_run that
# follows it in this process, which then need not read it again.
_claimed: tuple[tuple[Path, str | None, str], tuple[Path | None, list[str]]] | None = None


def _claimed_resume(folder: Path, resume_from_checkpoint: str | None,
                    resume_flag: str) -> tuple[Path | None, list[str]]:
    """:func:`resume_candidates` as :func:`claim_output_dir` found them for the same request, or read now."""
    global _claimed
    claimed, _claimed = _claimed, None
    if claimed is not None and claimed[0] == (folder, resume_from_checkpoint, resume_flag):
        return claimed[1]
    return resume_candidates(folder, resume_from_checkpoint, resume_flag)


def claim_output_dir(output_dir: str | Path, *, overwrite: bool, resume_from_checkpoint: str | None,
                     resume_flag: str = "--resume_from_checkpoint", config_toml: str = "",
                     resume_must_match: tuple[str, ...] = ()) -> Path:
    """Refuse an ``--output_dir`` this run must not write into (see ``dreamstep.engine.run_folder``):
    another live run's, or one holding files a fresh run would overwrite; and a checkpoint to resume that
    was trained with other ``resume_must_match`` settings (the flags that shape the trained weights) than
    ``config_toml``'s. Writes nothing."""
    end_unfinished_run("a later run in the same process started")
    take_said_before_the_run()  # what an earlier command of this process said (a --dry_run's plan) is not ours
    global _claimed
    found = resume_candidates(output_dir, resume_from_checkpoint, resume_flag)
    _claimed = ((Path(output_dir), resume_from_checkpoint, resume_flag), found)
    resume = found[0]
    if resume is not None:
        check_resume_settings(resume, config_toml, resume_must_match)
    return check_output_dir(output_dir, overwrite=overwrite, resume=resume, resume_request=resume_from_checkpoint,
                            resume_flag=resume_flag)


def configure_gpu_precision(device: torch.device, mixed_precision: str, allow_tf32: bool,
                            bf16_supported: Callable[[], bool] | None = None) -> str | None:
    """On a CUDA device, let fp32 matmuls and convolutions use TF32 tensor cores (10-bit mantissa, fp32
    range) as ``allow_tf32`` says; elsewhere change nothing. Returns a one-line warning when the run
    computes in fp32 (``mixed_precision`` neither fp16 nor bf16) on a card that has bf16 (``bf16_supported``:
    default ``torch.cuda.is_bf16_supported``)."""
    if device.type != "cuda":
        return None
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    if mixed_precision in ("fp16", "bf16"):
        return None
    if not (bf16_supported or torch.cuda.is_bf16_supported)():
        return None
    math = "TF32 matmuls" if allow_tf32 else "full fp32 matmuls (--allow_tf32 false)"
    return (f"warning: training in fp32 ({math}, --mixed_precision no) on a GPU with bf16: "
            "--mixed_precision bf16 is about twice as fast and halves the frozen weights' memory")


def start_run(output_dir: str | Path, *, mixed_precision: str, seed: int, report_to: str,
              resume_from_checkpoint: str | None, config_toml: str, tensorboard_dir: str | Path | None = None,
              command: str = "dreamstep train", resume_flag: str = "--resume_from_checkpoint",
              overwrite: bool = False, samples_dir: str | Path | None = None,
              find_unused_parameters: bool = False, allow_tf32: bool = True) -> Run:
    """Set up the accelerator (devices, autocast, processes), seed everything, find the checkpoint to
    resume from (checked by :func:`claim_output_dir`), and take the output folder: its lock and
    ``run_status.json`` (main process). ``config.toml`` and the logs are written when training starts.
    TensorBoard event files go to ``tensorboard_dir`` (default: ``output_dir``), sample grids to
    ``samples_dir`` (default: ``output_dir/samples``). ``command`` (e.g. ``dreamstep train flux-lora``)
    and ``resume_flag`` make the command printed to continue an interrupted run. ``find_unused_parameters``:
    DDP looks for trainable parameters that got no gradient in a step (slower; needed when some may not).
    ``allow_tf32``: fp32 matmuls on a CUDA card use TF32 (see :func:`configure_gpu_precision`)."""
    end_unfinished_run("a later run in the same process started")
    accelerator = _accelerator(mixed_precision, find_unused_parameters)
    if accelerator.distributed_type == "DEEPSPEED":
        raise UserError("accelerate launch --use_deepspeed: DeepSpeed would take over accumulation, loss scaling and "
                        "clipping from dreamstep's engine; launch without it (DDP), or shard with --zero_stage 2|3 "
                        "(flux-controlnet)")
    if mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError("--mixed_precision fp16 needs a GPU (CPUs have no fp16 autocast); use bf16 or no")
    warning = configure_gpu_precision(accelerator.device, mixed_precision, allow_tf32)
    if warning is not None:
        say(warning, is_main_process=accelerator.is_main_process, file=sys.stderr)
    from accelerate.utils import set_seed

    set_seed(seed)
    folder = Path(output_dir)
    resume_from, passed_over = _claimed_resume(folder, resume_from_checkpoint, resume_flag)
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
    run.preamble += take_said_before_the_run()
    for warning in passed_over:
        say_and_log(run, warning)
    global _open_run
    _open_run = run
    run.signals.hint = "nothing was trained yet; run the same command again to start over"
    run.signals.install()
    if resume_from_checkpoint and run.resume_from is None:
        say_and_log(run, f"note: {folder} has no checkpoint yet, so this is a fresh run")
    return run


def _accelerator(mixed_precision: str, find_unused_parameters: bool) -> Any:
    from accelerate.utils import DistributedDataParallelKwargs

    # Several processes without GPUs (accelerate launch on CPUs) need accelerate's CPU mode for gloo.
    cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    ddp = [DistributedDataParallelKwargs(find_unused_parameters=True)] if find_unused_parameters else []
    try:
        return make_accelerator(mixed_precision=mixed_precision, cpu=cpu_processes, kwargs_handlers=ddp)
    except ValueError as e:
        if "already been initialized" not in str(e):
            raise
        # accelerate keeps one precision per process (a notebook that trains twice).
        raise UserError(f"--mixed_precision {mixed_precision}: this process already trained in another precision; "
                        "run this training in a new process (in a notebook: restart the kernel)") from None


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
    changed = [k for k in (*_RESUME_STATE, *_RESUME_NOTES) if k in saved and k in current and saved[k] != current[k]]
    for key in changed:
        was, now = _flag_value(saved[key]), _flag_value(current[key])
        if key in _RESUME_STATE:
            raise UserError(f"--{key} is {now} but {checkpoint} was trained with {was}: {_RESUME_STATE[key]}; "
                            f"resume with --{key} {was}, or start a new run in another --output_dir")
        print(f"note: --{key} is {now} but {checkpoint} was trained with {was}: {_RESUME_NOTES[key]}")


# Settings a checkpoint's state depends on, so a resume with another value is refused, and why.
_DATA = "its data position and cached latents belong to that value"
_RESUME_STATE = {
    "optimizer": "its optimizer state is that optimizer's", "optimizer_type": "its optimizer state is that optimizer's",
    "resolution": _DATA, "train_batch_size": _DATA, "gradient_accumulation_steps": _DATA,
    "validation_split": "its training images are the ones that split left", "dataset_config": _DATA,
    "base_quantization": "its weights were fit to the base quantized that way", "fp8_base":
        "its weights were fit to the base quantized that way",
    "text_encoder_quantization": "its cached text embeddings came from that encoder",
    "seed": "the order of its data and its held-out images follow that seed",
}
# Settings a resume may change; what the change does is said.
_LR = "the checkpoint's learning-rate schedule continues from its own value; for a new learning rate start a new run"
_RESUME_NOTES = {
    "learning_rate": _LR, "unet_lr": _LR, "text_encoder_lr": _LR,
}


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
    removed = remove_leftovers(run.output_dir)
    if previous is not None or removed:
        killed = f"process {previous.get('pid')}" if previous is not None else "a run"
        what = (["took over its lock"] if previous is not None else []) + (
            [f"removed its unfinished save{'s' if len(removed) > 1 else ''} {', '.join(removed)}"] if removed else [])
        say_and_log(run, f"note: {killed} ended here without finishing; {' and '.join(what)}")
    with contextlib.suppress(OSError):
        run.previous_status = (run.output_dir / STATUS_FILE).read_bytes()
    run.status = RunStatus(run.output_dir)
    run.status.update()
    atexit.register(run._close_at_exit)


def _resume_command(command: str, folder: Path, resume_flag: str, num_processes: int) -> str:
    """The resolved settings are saved in ``config.toml``, so this continues the run exactly (a random
    seed included), whatever the original command line was."""
    if num_processes > 1:
        command = f"accelerate launch --multi_gpu --num_processes {num_processes} -m {command}"
    return f"{command} --config {shlex.quote(str(folder / 'config.toml'))} {resume_flag} latest"


def say_and_log(run: Run, message: str) -> None:
    """Note ``message`` in the run's ``train.log`` once that is open, then print it once (main process)."""
    if run.is_main_process and run.logger is not None:
        run.logger.note(message)
    elif run.is_main_process:
        run.preamble.append(message)
    say(message, is_main_process=run.is_main_process)
