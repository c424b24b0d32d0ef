"""The plan of a run, made before any model loads: the optimizer and learning-rate schedule checked by name
and arguments on a stand-in parameter, and the step counts that every schedule of the run works from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dreamstep.data.dataset import make_dataloader
from dreamstep.engine.optim import build_lr_scheduler, build_optimizer


@dataclass(frozen=True)
class TrainingPlan:
    """``steps_per_epoch``: optimizer steps in one pass over a process's batches; ``total_steps``: optimizer
    steps of the whole run; ``warmup_steps``: those of them that warm the learning rate up."""

    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.total_steps / self.steps_per_epoch)


def plan_steps(batches_per_epoch: int, *, gradient_accumulation_steps: int, max_train_steps: int | None,
               num_epochs: int | None, warmup: float = 0) -> TrainingPlan:
    """Step counts for ``max_train_steps`` optimizer steps, or ``num_epochs`` epochs when it is None. An
    epoch's last group may be short, so an epoch is ``ceil(batches / accumulation)`` optimizer steps.
    ``warmup`` below 1 is a fraction of the total (sd-scripts' ``--lr_warmup_steps 0.1``)."""
    steps_per_epoch = math.ceil(batches_per_epoch / gradient_accumulation_steps)
    total = max_train_steps if max_train_steps is not None else num_epochs * steps_per_epoch
    warmup_steps = int(warmup * total) if 0 < warmup < 1 else int(warmup)
    return TrainingPlan(steps_per_epoch, total, warmup_steps)


def loader_and_plan(run: Any, dataset: Any, *, seed: int, num_workers: int, gradient_accumulation_steps: int,
                    max_train_steps: int | None, num_epochs: int | None, warmup: float = 0) -> tuple[Any, TrainingPlan]:
    """The data loader of this process's share of ``dataset`` (a ``BucketDataset``) in a started ``run``, and
    the run's step counts (:func:`plan_steps`) over it."""
    loader = make_dataloader(dataset, seed=seed, num_workers=num_workers, num_replicas=run.accelerator.num_processes,
                             rank=run.accelerator.process_index)
    return loader, plan_steps(len(loader), gradient_accumulation_steps=gradient_accumulation_steps,
                              max_train_steps=max_train_steps, num_epochs=num_epochs, warmup=warmup)


def check_optimization(optimizer: str, learning_rate: float, *, lr_scheduler: str, num_cycles: int = 1,
                       power: float = 1.0, optimizer_flag: str = "--optimizer", **optimizer_options: Any) -> None:
    """Build the optimizer and the schedule once on a stand-in parameter, so an unknown name, a missing
    package or a bad argument is reported before any model loads. ``optimizer_options`` are those of
    :func:`~dreamstep.engine.optim.build_optimizer`."""
    stand_in = build_optimizer(optimizer, [torch.nn.Parameter(torch.zeros(1))], learning_rate,
                               flag=optimizer_flag, **optimizer_options)
    build_lr_scheduler(lr_scheduler, stand_in, warmup_steps=0, total_steps=1, num_cycles=num_cycles, power=power)
