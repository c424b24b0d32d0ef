"""The training loop every recipe uses: epochs of micro-batches through a :class:`TrainStep`, with progress,
logging, hooks on a step or epoch cadence (save, sample, checkpoint), non-finite loss detection, and exact
resume.

Exact resume means: N optimizer steps straight give the same weights, optimizer and scheduler state, random
numbers and data order as k steps, a checkpoint, a new process and N-k more steps. The loop gets there by
owning the RNG timeline of an epoch:

1. just before an epoch's batches are created it records the RNG state (``epoch_start_rng``);
2. on resume it restores that state, creates the epoch's batches again (same shuffled order, whether the
   order comes from a seeded generator, ``set_epoch`` or the global RNG), and skips the batches already
   trained on: a batch sampler whose ``set_epoch(epoch, skip_batches)`` takes a skip count (dreamstep's
   bucket sampler, whose augmentation depends only on seed, epoch and sample) leaves them out unread and
   unencoded; other data is iterated over (so worker-side random augmentation advances identically);
3. then it restores the RNG state saved with the checkpoint, so ``forward`` draws the same noise.

Nothing waits for the device on most steps: each optimizer step's loss (under several processes averaged
over them first, so every process sees the same value and takes the same stop/continue decision), gradient
norm and non-finite flag stay device tensors, and are read together every ``log_every`` steps, before a hook
runs and at the end. Then every step's values are logged under their own step and time, the progress bar's
loss is updated, and a non-finite loss is reported (or stops the run) naming the step it happened at.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from dreamstep.engine.checkpoint import (
    LoadedCheckpoint,
    TrainingPosition,
    capture_rng_state,
    restore_rng_state,
)
from dreamstep.engine.logging import TrainingLogger, say
from dreamstep.engine.train_step import TrainStep
from dreamstep.errors import UserError

__all__ = ["AnyOf", "Every", "Hook", "NonFiniteLossError", "TrainingResult", "epoch_generator", "run_training"]

DataSource = Iterable[Any] | Callable[[int], Iterable[Any]]
_END = object()


class NonFiniteLossError(UserError):
    """The loss became NaN or infinite and ``on_nonfinite_loss="stop"``."""


@dataclass
class TrainingResult:
    """``losses``: one group-mean loss per optimizer step of this run (NaN/inf included when skipped);
    ``position``: where the run stopped (give it to ``save_checkpoint`` for a final checkpoint);
    ``skipped_steps``: global steps whose update was skipped (non-finite gradients or loss);
    ``nonfinite_steps``: those of them whose loss was NaN/inf; ``total_steps``: the steps the run was
    planned for; ``stopped``: True when ``on_step`` ended the run early."""

    losses: list[float] = field(default_factory=list)
    position: TrainingPosition = field(default_factory=TrainingPosition)
    skipped_steps: list[int] = field(default_factory=list)
    nonfinite_steps: list[int] = field(default_factory=list)
    total_steps: int = 0
    stopped: bool = False


@dataclass(frozen=True)
class Every:
    """A cadence: every ``steps`` optimizer steps and at the end of every ``epochs``-th epoch (None: never)."""

    steps: int | None = None
    epochs: int | None = None

    def due(self, global_step: int, steps_per_epoch: int) -> bool:
        by_steps = bool(self.steps) and global_step % self.steps == 0
        by_epochs = bool(self.epochs) and global_step % (self.epochs * steps_per_epoch) == 0
        return by_steps or by_epochs


@dataclass(frozen=True)
class AnyOf:
    """Due when any of ``cadences`` is."""

    cadences: tuple[Every, ...]

    def __init__(self, *cadences: Every):
        object.__setattr__(self, "cadences", cadences)

    def due(self, global_step: int, steps_per_epoch: int) -> bool:
        return any(c.due(global_step, steps_per_epoch) for c in self.cadences)


@dataclass(frozen=True)
class Hook:
    """``action(position)`` after each optimizer step at which ``every`` is due (``position`` is a copy)."""

    every: Every | AnyOf
    action: Callable[[TrainingPosition], Any]


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator for an epoch's shuffling that depends only on (seed, epoch): pass it as a DataLoader's
    ``generator`` in a ``make_dataloader(epoch)`` factory."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def run_training(step: TrainStep, data: DataSource, *, max_train_steps: int | None = None,
                 num_epochs: int | None = None, resume: LoadedCheckpoint | None = None, hooks: Sequence[Hook] = (),
                 logger: TrainingLogger | None = None,
                 on_nonfinite_loss: Literal["stop", "skip"] = "stop", max_skipped_fraction: float = 1.0,
                 on_step: Callable[[TrainingPosition, float | None, int], bool] | None = None,
                 progress: bool = True, log_every: int = 1) -> TrainingResult:
    """Train until ``max_train_steps`` optimizer steps or ``num_epochs`` epochs, whichever comes first.

    ``data`` is either a function ``epoch -> iterable of batches`` or an iterable with a deterministic
    order per epoch (``set_epoch(epoch)`` is called on it, or on its ``batch_sampler``/``sampler``, when
    present). A tuple/list batch is passed to the step as ``step(*batch)``, anything else as ``step(batch)``.
    After each optimizer step (and its logging) the due ``hooks`` run in their order: put sampling before
    checkpointing, so a checkpoint taken at the same step holds the RNG state after sampling. ``resume`` is
    what ``load_checkpoint`` returned.
    ``on_nonfinite_loss``: ``"stop"`` raises :class:`NonFiniteLossError` naming the step; ``"skip"`` reports
    it and goes on (TrainStep has already skipped the update, as the gradients are then non-finite too), until
    more than ``max_skipped_fraction`` of the planned steps were skipped: then the run has diverged and
    :class:`NonFiniteLossError` says so. ``on_step(position, loss, total_steps)`` runs after each optimizer
    step and its hooks, with the step's loss when it was read at that step (every ``log_every`` steps, see
    the module docstring), else None; when it returns True on any process, every process stops after that
    step (``result.stopped``).
    """
    _check_arguments(max_train_steps, num_epochs, on_nonfinite_loss, max_skipped_fraction)
    if log_every < 1:
        raise ValueError(f"log_every must be >= 1, got {log_every}")
    position = dataclasses.replace(resume.position) if resume is not None else TrainingPosition()
    resume_rng = resume.rng_state if resume is not None else None
    result = TrainingResult(position=position)
    bar = None
    try:
        while not result.stopped and not _finished(position, max_train_steps, num_epochs):
            batches = _open_epoch(data, position, resuming=resume is not None and bar is None)
            steps_per_epoch = _steps_per_epoch(step, batches)
            if max_train_steps is None:
                max_train_steps = num_epochs * steps_per_epoch
            result.total_steps = max_train_steps
            if bar is None:
                bar = _progress_bar(step, position.global_step, max_train_steps, progress)
                unread = _Unread(step, result, bar, logger, on_nonfinite_loss, max_skipped_fraction)
            iterator = _skip(data, batches, position)
            if resume_rng is not None:
                restore_rng_state(resume_rng)
                resume_rng = None
            _check_alignment(step, position.batch_in_epoch)
            if _train_epoch(step, iterator, position, steps_per_epoch, unread, hooks, on_step, log_every):
                position.epoch += 1
                position.batch_in_epoch = 0
        if bar is not None:
            unread.read()
    finally:
        if bar is not None:
            bar.close()
    return result


def _train_epoch(step: TrainStep, iterator: Iterator[Any], position: TrainingPosition, steps_per_epoch: int,
                 unread: _Unread, hooks: Sequence[Hook],
                 on_step: Callable[[TrainingPosition, float | None, int], bool] | None, log_every: int) -> bool:
    """Run the rest of an epoch; return True when the epoch's data ran out (False: max steps reached, or
    ``on_step`` asked to stop); the steps' values are read before it returns, except at the end of the data."""
    result = unread.result
    for batch in iterator:
        outputs = step(*batch) if isinstance(batch, (tuple, list)) else step(batch)
        position.batch_in_epoch += 1
        if not step.sync_gradients:
            continue
        position.global_step += 1
        unread.add(position, _global_loss(step, outputs[0]))
        due = [hook for hook in hooks if hook.every.due(position.global_step, steps_per_epoch)]
        last = position.global_step >= result.total_steps
        loss = unread.read() if due or last or position.global_step % log_every == 0 else None
        for hook in due:
            hook.action(dataclasses.replace(position))
        if on_step is not None and _any_process(step, on_step(dataclasses.replace(position), loss,
                                                              result.total_steps)):
            unread.read()
            result.stopped = True
            return False
        if last:
            return False
    return True


class _Unread:
    """Optimizer steps whose loss, gradient norm and non-finite flag are still device tensors; :meth:`read`
    fetches them in one go and records each step as it happened (result, logger, progress bar)."""

    def __init__(self, step: TrainStep, result: TrainingResult, bar: Any, logger: TrainingLogger | None,
                 on_nonfinite_loss: str, max_skipped_fraction: float) -> None:
        self.step, self.result, self.bar, self.logger = step, result, bar, logger
        self.on_nonfinite_loss, self.max_skipped_fraction = on_nonfinite_loss, max_skipped_fraction
        self.steps: list[tuple[TrainingPosition, float, float, float]] = []  # position, time, lr, loss scale
        self.tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # loss, grad norm, non-finite

    def add(self, position: TrainingPosition, loss: torch.Tensor) -> None:
        step = self.step
        lr = step.optimizer.param_groups[0]["lr"]
        self.steps.append((dataclasses.replace(position), time.time(), lr, step.loss_scale))
        self.tensors.append((loss.detach().reshape(()), step.grad_norm_tensor.reshape(()),
                             step.nonfinite_tensor.reshape(())))
        self.bar.update(1)

    def read(self) -> float | None:
        """Record the unread steps (this waits for the device); return the last one's loss (None: none)."""
        if not self.steps:
            return None
        losses, norms, nonfinite = (torch.stack(column).tolist() for column in zip(*self.tensors))
        steps, self.steps, self.tensors = self.steps, [], []
        for (position, at, lr, loss_scale), loss, norm, skipped in zip(steps, losses, norms, nonfinite):
            self._record(position, at, lr, loss_scale, loss, norm, bool(skipped))
        return losses[-1]

    def _record(self, position: TrainingPosition, at: float, lr: float, loss_scale: float, loss: float,
                grad_norm: float, skipped: bool) -> None:
        """Append the loss, log the step's scalars, update the bar; handle a non-finite loss or skipped update."""
        result = self.result
        result.losses.append(loss)
        where = f"step {position.global_step} (epoch {position.epoch}, batch {position.batch_in_epoch})"
        if not math.isfinite(loss):
            if self.on_nonfinite_loss == "stop":
                raise NonFiniteLossError(
                    f"loss is {loss} at {where}; the update was not applied. Lower the learning rate, check the "
                    "data, prefer bf16 over fp16, or pass --on_nonfinite_loss skip to continue past such steps")
            result.nonfinite_steps.append(position.global_step)
            allowed = self.max_skipped_fraction * result.total_steps
            if len(result.nonfinite_steps) > allowed:
                raise NonFiniteLossError(
                    f"{len(result.nonfinite_steps)} of the {result.total_steps} steps had a non-finite loss "
                    f"(steps {_step_list(result.nonfinite_steps)}), more than --max_skipped_steps_fraction "
                    f"{self.max_skipped_fraction:g} allows: the run has diverged. Lower the learning rate or "
                    "check the data")
            _warn(self.step, f"warning: loss is {loss} at {where}; skipping this step")
        if skipped:
            result.skipped_steps.append(position.global_step)
            if math.isfinite(loss):
                _warn(self.step, f"note: gradients overflowed at {where}; update skipped, loss scale now "
                                 f"{loss_scale:g}")
        if self.logger is not None:
            scalars = {"loss": loss, "lr": lr, "loss_scale": loss_scale, "skipped": float(skipped)}
            if math.isfinite(grad_norm):
                scalars["grad_norm"] = grad_norm
            self.logger.log(position.global_step, scalars, at=at)
        self.bar.set_postfix(loss=f"{loss:.4g}", lr=f"{lr:.3g}", refresh=False)


def _global_loss(step: TrainStep, loss: torch.Tensor) -> torch.Tensor:
    """The group's mean loss averaged over processes (one scalar all-reduce per optimizer step), on the
    device: nothing waits for it here."""
    accelerator = step.accelerator
    if accelerator is not None and accelerator.num_processes > 1:
        loss = accelerator.reduce(loss.detach().to(accelerator.device), reduction="mean")
    return loss


def _step_list(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def _any_process(step: TrainStep, flag: bool) -> bool:
    """True on every process when ``flag`` is True on any (one scalar all-reduce under several processes)."""
    accelerator = step.accelerator
    if accelerator is None or accelerator.num_processes == 1:
        return flag
    value = torch.tensor(float(flag), device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum") > 0)


def _finished(position: TrainingPosition, max_train_steps: int | None, num_epochs: int | None) -> bool:
    if max_train_steps is not None and position.global_step >= max_train_steps:
        return True
    return num_epochs is not None and position.epoch >= num_epochs


def _epoch_target(data: DataSource) -> Any:
    """What takes ``set_epoch``: the data itself, its batch sampler or its sampler (None: nothing)."""
    for target in (data, getattr(data, "batch_sampler", None), getattr(data, "sampler", None)):
        if hasattr(target, "set_epoch"):
            return target
    return None


def _open_epoch(data: DataSource, position: TrainingPosition, resuming: bool) -> Iterable[Any]:
    """Record (or, resuming, restore) the epoch's starting RNG state, then make the epoch's batches."""
    if resuming and position.epoch_start_rng is not None:
        restore_rng_state(position.epoch_start_rng)
    position.epoch_start_rng = capture_rng_state()
    if callable(data) and not hasattr(data, "__iter__"):
        return data(position.epoch)
    target = _epoch_target(data)
    if target is not None:
        target.set_epoch(position.epoch)
    return data


def _skip(data: DataSource, batches: Iterable[Any], position: TrainingPosition) -> Iterator[Any]:
    """The epoch's batches after the ``position.batch_in_epoch`` a resumed run already trained on: left out
    by the batch sampler where it can, else consumed."""
    count = position.batch_in_epoch
    target = None if callable(data) and not hasattr(data, "__iter__") else _epoch_target(data)
    if count and target is not None and "skip_batches" in inspect.signature(target.set_epoch).parameters:
        _check_skippable(count, len(batches))  # type: ignore[arg-type]
        target.set_epoch(position.epoch, skip_batches=count)
        # iter() starts the loader now, as consuming would have: it draws its seed from the RNG that the loop
        # then sets to the checkpoint's state. The first batch is read (and encoded) after that, as it is in
        # an uninterrupted run.
        return iter(batches)
    iterator = iter(batches)
    for consumed in range(count):
        if next(iterator, _END) is _END:
            _check_skippable(count, consumed)
    return iterator


def _check_skippable(count: int, available: int) -> None:
    if count > available:
        raise UserError(f"the checkpoint is {count} batches into its epoch but the data now has only "
                        f"{available}; resume with the same dataset and batch size")


def _steps_per_epoch(step: TrainStep, batches: Iterable[Any]) -> int:
    try:
        length = len(batches)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError("the training data must have a length (len(dataloader))") from None
    if step.length_of_dataloader is not None and step.length_of_dataloader != length:
        raise ValueError(f"TrainStep was built with length_of_dataloader={step.length_of_dataloader} "
                         f"but an epoch has {length} batches")
    return math.ceil(length / step.gradient_accumulation_steps)


def _check_alignment(step: TrainStep, batch_in_epoch: int) -> None:
    """The TrainStep's accumulation groups must start where the loop thinks the epoch stands."""
    if step.length_of_dataloader is None:
        return
    expected = batch_in_epoch % step.length_of_dataloader
    if step.micro_step != expected:
        raise RuntimeError(f"TrainStep is at micro-batch {step.micro_step} of its epoch but the loop is at "
                           f"{expected}; load the TrainStep state from the same checkpoint as the position")


def _progress_bar(step: TrainStep, initial: int, total: int, enabled: bool) -> Any:
    """tqdm shows it/s and the ETA; only the main process draws it."""
    is_main = step.accelerator is None or step.accelerator.is_main_process
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                disable=not (enabled and is_main))


def _warn(step: TrainStep, message: str) -> None:
    say(message, is_main_process=step.accelerator is None or step.accelerator.is_main_process, file=sys.stderr)


def _check_arguments(max_train_steps: int | None, num_epochs: int | None, on_nonfinite_loss: str,
                     max_skipped_fraction: float) -> None:
    if max_train_steps is None and num_epochs is None:
        raise ValueError("give max_train_steps or num_epochs")
    if on_nonfinite_loss not in ("stop", "skip"):
        raise ValueError(f"on_nonfinite_loss must be 'stop' or 'skip', got {on_nonfinite_loss!r}")
    if not 0.0 <= max_skipped_fraction <= 1.0:
        raise ValueError(f"max_skipped_fraction must be in [0, 1], got {max_skipped_fraction}")
