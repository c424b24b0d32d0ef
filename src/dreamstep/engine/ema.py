"""An exponential moving average (EMA) of the trained weights, kept by diffusers' ``EMAModel``.

After every ``update_every``-th optimizer step the average moves toward the weights: e ← d·e + (1 - d)·w, with the
decay d of the n-th update warmed up as diffusers does it: min(decay, (1 + k) / (10 + k)) with k = n - 1 (the first
update copies the weights), or with ``warmup_power`` p, min(decay, 1 - (1 + k)^-p) (Karras et al.'s power warm-up,
``use_ema_warmup``). ``on_cpu`` keeps the average in host memory for small cards: each update copies the weights
there and averages on the CPU (the step then waits for the device).

The average is checkpointed beside the weights (:class:`TrainedWithAverage`), so a resumed run continues it
exactly, and :meth:`WeightAverage.swapped_in` lends it to the model for samples, evaluation and saving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from dreamstep.errors import UserError

EMA_PREFIX = "ema."
_EMA_STEPS = "ema_updates"


class WeightAverage:
    """The EMA of the parameters of ``model`` that train (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, decay: float, update_every: int = 1,
                 warmup_power: float | None = None, on_cpu: bool = False):
        from diffusers.training_utils import EMAModel  # seconds to import: not for what reads checkpoints only

        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.update_every = update_every
        self.on_cpu = on_cpu
        options = {"use_ema_warmup": True, "power": warmup_power} if warmup_power is not None else {}
        # The average is at least fp32 whatever the weights' dtype: a bf16 average would lose every small step.
        device = "cpu" if on_cpu else None
        self.average = EMAModel([p.detach().to(device, _average_dtype(p)) for p in self.parameters], decay=decay,
                                **options)

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named]

    def _sources(self) -> list[torch.Tensor]:
        if not self.on_cpu:
            return self.parameters
        # EMAModel averages a tensor that requires grad and copies one that does not: the host copies must too.
        return [p.detach().to("cpu", _average_dtype(p)).requires_grad_() for p in self.parameters]

    def update(self, optimizer_steps: int) -> None:
        """Called after each optimizer step (``optimizer_steps`` of the run so far); averages on the cadence."""
        if optimizer_steps % self.update_every == 0:
            self.average.step(self._sources())

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average inside the block, its own weights again after it."""
        self.average.store(self.parameters)
        self.average.copy_to(self.parameters)
        try:
            yield
        finally:
            self.average.restore(self.parameters)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average under ``ema.<parameter name>`` and the count of updates (which sets the decay)."""
        state = {f"{EMA_PREFIX}{name}": shadow for (name, _), shadow in zip(self.named, self.average.shadow_params)}
        return {**state, f"{EMA_PREFIX}{_EMA_STEPS}": torch.tensor(self.average.optimization_step)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for (name, _), shadow in zip(self.named, self.average.shadow_params):
            shadow.copy_(state[f"{EMA_PREFIX}{name}"])
        self.average.optimization_step = int(state[f"{EMA_PREFIX}{_EMA_STEPS}"])


def has_average(keys: Iterable[str]) -> bool:
    """Whether a checkpoint's weights (their keys) hold an EMA beside them (a run with --ema_decay)."""
    return f"{EMA_PREFIX}{_EMA_STEPS}" in keys


def chosen_weights(state: dict[str, torch.Tensor], average: bool) -> dict[str, torch.Tensor]:
    """A checkpoint's trained weights without the EMA kept beside them, or (``average``) the EMA in their place."""
    weights = {k: v for k, v in state.items() if not k.startswith(EMA_PREFIX)}
    if not average:
        return weights
    for key, value in state.items():
        if not key.startswith(EMA_PREFIX) or key == f"{EMA_PREFIX}{_EMA_STEPS}":
            continue
        name = _weight_key(key.removeprefix(EMA_PREFIX), weights)
        if name is None:
            raise UserError(f"the EMA weight '{key}' has no trained weight of that name in the checkpoint; use "
                            "its raw weights")
        weights[name] = value.to(weights[name].dtype)
    return weights


def _weight_key(parameter: str, weights: dict[str, torch.Tensor]) -> str | None:
    """The saved weight's key of the parameter named ``parameter``: the average is keyed by the parameter names of
    the module that trains, which may spell peft's adapter name (``lora_A.default.weight``) or hold the saved
    names under a container's own (``loras.<key>``)."""
    name = parameter.replace(".default.", ".")
    while name not in weights and "." in name:
        name = name.split(".", 1)[1]
    return name if name in weights else None


def _average_dtype(weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)


class TrainedWithAverage:
    """What a run trains and checkpoints (``trained``: its ``state_dict`` / ``load_state_dict``), with the EMA of
    its weights beside them in the same checkpoint file."""

    def __init__(self, trained: Any, average: WeightAverage):
        self.trained = trained
        self.average = average

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.trained.state_dict(), **self.average.state_dict()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if f"{EMA_PREFIX}{_EMA_STEPS}" not in state:
            raise UserError("the checkpoint holds no EMA weights (it was saved without --ema_decay); resume "
                            "without --ema_decay, or start a new run")
        self.trained.load_state_dict({k: v for k, v in state.items() if not k.startswith(EMA_PREFIX)})
        self.average.load_state_dict(state)


def weight_average(model: torch.nn.Module, options: dict[str, Any] | None) -> WeightAverage | None:
    """The EMA of ``model``'s trained weights with ``options`` (``EmaOptions.ema_options()``), or ``None``."""
    return WeightAverage(model, **options) if options is not None else None


def validation_weights(average: WeightAverage | None, use: bool) -> Callable[[], AbstractContextManager[None]]:
    """What a run validates with (``RunHooks.validation_weights``): the average when there is one and ``use``."""
    return average.swapped_in if average is not None and use else contextlib.nullcontext


def with_average(trained: Any, average: WeightAverage | None) -> Any:
    """``trained`` with the average checkpointed beside it, or ``trained`` itself without one."""
    return trained if average is None else TrainedWithAverage(trained, average)
