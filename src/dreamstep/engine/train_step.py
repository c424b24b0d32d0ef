"""One optimizer step hidden behind a call, in PyTorch, as mindone's trainers wrap theirs around MindSpore's
``TrainOneStepCell``.

A subclass writes only ``forward(*batch)`` and returns the micro-batch's mean loss, or ``(loss, *extras)``.
A ``forward`` written to mindone's contract, which calls ``self.scale_loss(loss)`` itself and returns the scaled
loss, works as written: the step does not scale what such a ``forward`` returns a second time.
Calling the step then runs, per micro-batch::

    forward -> scale its loss (:meth:`TrainStep.scale_loss`)
            -> backward (no gradient all-reduce unless this micro-batch closes a group)
    at the last micro-batch of a group: unscale -> global grad norm -> finite? -> clip -> optimizer.step
                                        -> lr_scheduler.step -> zero_grad -> loss scaler update

and returns ``(loss, *extras)`` where ``loss`` is the mean unscaled loss of the micro-batches of the current
accumulation group seen so far (at the group's last micro-batch: the group's mean loss, not loss / N).

A step whose run is evaluated also gives ``validation_loss_at(batch, latents, noise, fraction)``: the unweighted
loss of each held-out sample, (B,), at the fixed point ``fraction`` of its noise schedule, for given latents
and noise, under :meth:`TrainStep.autocast` and through :attr:`TrainStep.unwrapped_model` (see
:class:`dreamstep.evaluation.validation_loss.ValidationLoss`, which calls it).

Accumulation groups follow the epoch: with ``gradient_accumulation_steps=N`` and ``length_of_dataloader=L``
the micro-batches ``0..L-1`` of each epoch form groups of N, and the last group holds ``L mod N`` micro-batches
when N does not divide L. Each micro-batch's loss is divided by its group's real size, so a group of r
micro-batches of equal size gives exactly the gradient of one batch r times larger (the mindone port divides
by N, which shrinks the last group's update).

Non-finite gradients (any scaler, or none): the update is not applied, gradients are zeroed,
``step_skipped`` is set and the scaler is told. The dynamic scaler then backs off its scale; the static scaler
keeps its scale, so a static scale that overflows every step skips every step (pick a smaller scale, or the
dynamic scaler).

Host syncs: with no loss scaler and an optimizer that can skip an update on the device (torch's fused AdamW,
Adam, SGD and Adagrad, which take a ``found_inf`` tensor as ``GradScaler`` gives them), a step never waits for
the device: the loss, the gradient norm and the non-finite flag stay device tensors until someone reads them
(the training loop does on its logging cadence), and the LR scheduler steps at every group, skipped or not,
as diffusers' and sd-scripts' loops do. With a loss scaler, or another optimizer, whether the gradients are
finite is read once per optimizer step (as ``GradScaler`` does for such optimizers), and on a skipped update
the LR scheduler does not step either.

Mixed precision with an accelerate ``Accelerator``: the accelerator provides the device, ``autocast`` for
``forward`` and DDP ``no_sync`` (FSDP2 modules from ``dreamstep.engine.sharding`` pause their gradient sync
here); loss scaling is ours alone. With ``mixed_precision="fp16"`` on a GPU,
accelerate creates its own ``GradScaler`` which would scale the loss a second time and unscale the gradients
with the wrong factor, so ``TrainStep`` refuses an accelerator whose GradScaler is enabled: build it with
:func:`make_accelerator` (or pass ``GradScalerKwargs(enabled=False)``). When the accelerator's
``mixed_precision`` is ``"fp16"``, or trainable parameters are float16, and no ``loss_scaler`` is given, a
:class:`DynamicLossScaler` is used. Prepare the model and optimizer (and data) with
``accelerator.prepare`` but pass the LR scheduler unprepared: accelerate's scheduler wrapper steps it once
per process, while ``TrainStep`` steps it exactly once per optimizer step.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dreamstep.engine.sharding import is_sharded, no_gradient_sync

__all__ = ["DynamicLossScaler", "StaticLossScaler", "TrainStep", "make_accelerator"]


class StaticLossScaler:
    """Multiply the loss by a fixed ``scale``; gradients are divided by it before the optimizer sees them."""

    def __init__(self, scale: float = 2.0**16) -> None:
        if not scale > 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale_value = float(scale)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_value

    def unscale(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.scale_value

    def update(self, grads_finite: bool) -> None:
        """A static scale never changes (a non-finite step is still skipped by TrainStep)."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "static", "scale": self.scale_value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_type(state, "static")
        self.scale_value = float(state["scale"])


class DynamicLossScaler:
    """Loss scaling that halves the scale (by ``factor``) on non-finite gradients and grows it again after
    ``window`` consecutive finite steps, as MindSpore's ``DynamicLossScaler(scale_value, scale_factor,
    scale_window)`` and torch's ``GradScaler`` do. The scale never drops below ``min_scale``."""

    def __init__(self, scale: float = 2.0**16, factor: float = 2.0, window: int = 2000,
                 min_scale: float = 1.0) -> None:
        if not scale > 0 or not factor > 1 or window < 1:
            raise ValueError(f"need scale > 0, factor > 1, window >= 1; got {scale}, {factor}, {window}")
        self.scale_value = float(scale)
        self.factor = float(factor)
        self.window = int(window)
        self.min_scale = float(min_scale)
        self.good_steps = 0  # consecutive finite steps since the last change of scale

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_value

    def unscale(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.scale_value

    def update(self, grads_finite: bool) -> None:
        if not grads_finite:
            self.scale_value = max(self.scale_value / self.factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale_value *= self.factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"type": "dynamic", "scale": self.scale_value, "factor": self.factor, "window": self.window,
                "min_scale": self.min_scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_type(state, "dynamic")
        self.scale_value = float(state["scale"])
        self.factor = float(state["factor"])
        self.window = int(state["window"])
        self.min_scale = float(state["min_scale"])
        self.good_steps = int(state["good_steps"])


LossScaler = StaticLossScaler | DynamicLossScaler


def _check_type(state: dict[str, Any], expected: str) -> None:
    saved = state.get("type")
    if saved != expected:
        raise ValueError(f"loss scaler state is for a '{saved}' scaler, this one is '{expected}'")


def make_accelerator(**kwargs: Any) -> Any:
    """An ``accelerate.Accelerator`` whose own fp16 GradScaler is disabled, so TrainStep's scaler is the only
    one (see the module docstring). Takes the same keyword arguments as ``Accelerator``."""
    from accelerate import Accelerator
    from accelerate.utils import GradScalerKwargs

    handlers = [h for h in kwargs.pop("kwargs_handlers", []) if not isinstance(h, GradScalerKwargs)]
    accelerator = Accelerator(kwargs_handlers=[*handlers, GradScalerKwargs(enabled=False)], **kwargs)
    prepare_model = accelerator.prepare_model

    def prepare_model_without_frozen(model: torch.nn.Module, *args: Any, **options: Any) -> Any:
        ignore_frozen_parameters_in_ddp(model)
        return prepare_model(model, *args, **options)

    accelerator.prepare_model = prepare_model_without_frozen  # what accelerator.prepare calls for each model
    return accelerator


def ignore_frozen_parameters_in_ddp(model: torch.nn.Module) -> None:
    """Keep DDP away from the parameters that get no gradient (the frozen base): it would broadcast each from the
    first process when it wraps the model, which every process loaded alike anyway (24 GB for a bf16 FLUX.1), and
    which torchao's quantized weights cannot do (int8: no ``aten.view``; fp8: an assertion)."""
    from torch.nn.parallel import DistributedDataParallel

    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)


class TrainStep(abc.ABC):
    """Base class of every recipe's train step; see the module docstring for what a call does.

    After each call these attributes describe it, for logging:
    ``sync_gradients`` (this micro-batch closed a group), ``optimizer_stepped``, ``step_skipped`` (non-finite
    gradients), ``grad_norm`` (global L2 norm before clipping, at group ends, else ``None``) and
    ``loss_scale``. ``num_updates`` counts finished groups, stepped or skipped; ``num_skipped`` the skipped.
    Those read from the device wait for it; ``grad_norm_tensor`` and ``nonfinite_tensor`` do not.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None,
                 loss_scaler: LossScaler | None = None, max_grad_norm: float | None = None,
                 gradient_accumulation_steps: int = 1, length_of_dataloader: int | None = None,
                 accelerator: Any = None, gradient_accumulation_kwargs: dict[str, Any] | None = None,
                 ema: Any = None) -> None:
        """``gradient_accumulation_kwargs={"length_of_dataloader": L}`` is mindone's spelling of
        ``length_of_dataloader`` and is accepted so that ported mindone code runs unchanged. ``ema``
        (:class:`~dreamstep.engine.ema.WeightAverage`) is told ``update(num_updates)`` after every group. A step
        without an ``optimizer`` only evaluates (``validation_loss_at``: ``dreamstep eval`` scoring a run's
        checkpoints as the run did); calling it is an error."""
        length_of_dataloader = _length_from_kwargs(length_of_dataloader, gradient_accumulation_kwargs)
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        if gradient_accumulation_steps > 1 and not length_of_dataloader:
            raise ValueError("length_of_dataloader is required with gradient_accumulation_steps > 1: it tells "
                             "where the last, shorter accumulation group of an epoch ends")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        _check_accelerator(accelerator, lr_scheduler)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.accelerator = accelerator
        self.max_grad_norm = max_grad_norm
        self.ema = ema
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.length_of_dataloader = length_of_dataloader
        self.loss_scaler = loss_scaler if loss_scaler is not None else _default_scaler(accelerator, optimizer)
        self.micro_step = 0  # index of the next micro-batch within the epoch, 0 .. length_of_dataloader-1
        self.num_updates = 0
        self.sync_gradients = False
        # Device tensors of the last call that closed a group (None after one that did not): the global
        # gradient norm before clipping, and whether it was not finite (the update was skipped).
        self.grad_norm_tensor: torch.Tensor | None = None
        self.nonfinite_tensor: torch.Tensor | None = None
        self._skip_count: torch.Tensor | int = 0  # skipped updates, summed on the device
        self._group_loss_sum: torch.Tensor | None = None  # sum of unscaled micro-batch losses, shape ()
        self._group_count = 0
        self._scaled_in_forward = False  # forward called scale_loss itself (mindone's contract)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)

    @abc.abstractmethod
    def forward(self, *batch: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Compute the mean loss of one micro-batch; return it, or ``(loss, *extras)``. The step scales it, unless
        ``forward`` returns ``self.scale_loss(loss)`` (mindone's spelling)."""

    def validation_loss_at(self, batch: Any, latents: torch.Tensor, noise: torch.Tensor,
                           fraction: float) -> torch.Tensor:
        """The unweighted loss of each sample, (B,), at ``fraction`` of the noise schedule (see the module
        docstring); a step whose run has a validation loss gives it."""
        raise NotImplementedError(f"{type(self).__name__} has no validation loss")

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The model without its DDP wrapper: for passes on one process (validation), which must not sync."""
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    @property
    def grad_norm(self) -> float | None:
        """The last group's global gradient norm before clipping (reading it waits for the device)."""
        return None if self.grad_norm_tensor is None else float(self.grad_norm_tensor)

    @property
    def step_skipped(self) -> bool:
        """Whether the last call closed a group whose update was skipped (reading it waits for the device)."""
        return self.nonfinite_tensor is not None and bool(self.nonfinite_tensor)

    @property
    def optimizer_stepped(self) -> bool:
        """Whether the last call closed a group and applied its update (reading it waits for the device)."""
        return self.nonfinite_tensor is not None and not bool(self.nonfinite_tensor)

    @property
    def num_skipped(self) -> int:
        """Skipped updates so far (reading it waits for the device)."""
        return int(self._skip_count)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale_value if self.loss_scaler is not None else 1.0

    @property
    def group_size(self) -> int:
        """Number of micro-batches in the group the next micro-batch belongs to (N, or fewer at epoch end)."""
        n = self.gradient_accumulation_steps
        if self.length_of_dataloader is None:
            return n
        group_start = self.micro_step // n * n
        return min(n, self.length_of_dataloader - group_start)

    @property
    def at_group_end(self) -> bool:
        """Whether the next micro-batch closes its accumulation group (and triggers the optimizer step)."""
        position_in_group = self.micro_step % self.gradient_accumulation_steps
        return position_in_group == self.group_size - 1

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Divide by the group's real size (mean over the group) and multiply by the loss scale (the step
        does this to what ``forward`` returns, unless ``forward`` called it).

        The loss is first widened to float32 (float64 stays): a half-precision loss times 2**16 would
        overflow before backward, turning every report into inf instead of letting the scaler back off.
        """
        self._scaled_in_forward = True
        loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
        loss = loss / self.group_size if self.group_size != 1 else loss
        return self.loss_scaler.scale(loss) if self.loss_scaler is not None else loss

    def unscale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`scale_loss` for one micro-batch: the micro-batch's own mean loss."""
        loss = self.loss_scaler.unscale(loss) if self.loss_scaler is not None else loss
        return loss * self.group_size if self.group_size != 1 else loss

    def __call__(self, *batch: Any) -> tuple[torch.Tensor, ...]:
        if self.optimizer is None:
            raise TypeError(f"this {type(self).__name__} has no optimizer: it only evaluates (validation_loss_at)")
        closes_group = self.at_group_end
        with self._sync_context(closes_group):
            outputs = self._forward_checked(batch)
            self._backward(outputs[0])
        loss = self._record_loss(outputs[0])
        self.sync_gradients = closes_group
        self.grad_norm_tensor = None
        self.nonfinite_tensor = None
        if closes_group:
            self._update()
            if self.ema is not None:
                self.ema.update(self.num_updates)
        self._advance()
        return (loss, *outputs[1:])

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints: loss scaler and the position in the epoch's accumulation groups.
        Only valid between groups: gradients of an unfinished group are not part of a checkpoint."""
        if self._group_count:
            raise RuntimeError("TrainStep.state_dict() called in the middle of an accumulation group; "
                               "checkpoint right after a call where sync_gradients is True")
        return {"micro_step": self.micro_step, "num_updates": self.num_updates, "num_skipped": self.num_skipped,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_scaler = state["loss_scaler"]
        if (saved_scaler is None) != (self.loss_scaler is None):
            raise ValueError("checkpoint and TrainStep disagree on whether a loss scaler is used")
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(saved_scaler)
        self.micro_step = int(state["micro_step"])
        self.num_updates = int(state["num_updates"])
        self._skip_count = int(state["num_skipped"])

    def _forward_checked(self, batch: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        """``forward``'s outputs, its loss scaled (by ``forward`` itself when it called :meth:`scale_loss`)."""
        self._scaled_in_forward = False
        with self.autocast():
            outputs = self.forward(*batch)
        loss, *extras = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return (loss if self._scaled_in_forward else self.scale_loss(loss), *extras)

    def _backward(self, scaled_loss: torch.Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(scaled_loss)
        else:
            scaled_loss.backward()

    def _record_loss(self, scaled_loss: torch.Tensor) -> torch.Tensor:
        """Accumulate this micro-batch's unscaled loss; return the group's running mean (shape ())."""
        micro_loss = self.unscale_loss(scaled_loss.detach())
        self._group_loss_sum = micro_loss if self._group_loss_sum is None else self._group_loss_sum + micro_loss
        self._group_count += 1
        return self._group_loss_sum / self._group_count if self._group_count != 1 else self._group_loss_sum

    def _advance(self) -> None:
        if self.sync_gradients:
            self._group_loss_sum = None
            self._group_count = 0
        self.micro_step += 1
        if self.length_of_dataloader is not None and self.micro_step >= self.length_of_dataloader:
            self.micro_step = 0

    def _update(self) -> None:
        """Unscale, measure, clip and step; or skip the update when the gradients are not finite."""
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._unscale_grads(params)
        norm = self._clip(params)
        nonfinite = torch.logical_not(torch.isfinite(norm))
        self.grad_norm_tensor, self.nonfinite_tensor = norm, nonfinite
        self._skip_count = self._skip_count + nonfinite.long()
        self.num_updates += 1
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # under accelerate's wrapper
        if self._skips_on_device(optimizer):
            self._step_unless(optimizer, nonfinite)
        else:
            self._step_if_finite(not bool(nonfinite))  # the one host sync per optimizer step
        self.optimizer.zero_grad(set_to_none=True)

    def _skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """No scaler to update on the host, an optimizer that takes ``found_inf``, and plain (unsharded)
        parameters, which the fused kernels require next to a plain ``found_inf``."""
        takes_found_inf = getattr(optimizer, "_step_supports_amp_scaling", False)
        return self.loss_scaler is None and takes_found_inf and not is_sharded(self.model)

    def _step_unless(self, optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
        """Step an optimizer that skips its update on the device when ``found_inf`` is 1 (GradScaler's
        protocol), so nothing waits for the device; the LR schedule follows the groups."""
        optimizer.grad_scale = None
        optimizer.found_inf = nonfinite.to(torch.float32)
        try:
            self.optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _step_if_finite(self, finite: bool) -> None:
        if finite:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(finite)

    def _unscale_grads(self, params: list[torch.nn.Parameter]) -> None:
        if self.loss_scale != 1.0:
            torch._foreach_mul_([p.grad for p in params], 1.0 / self.loss_scale)

    def _clip(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Clip to ``max_grad_norm`` (if set) and return the global norm before clipping (a device tensor).

        With no clipping the norm is still measured: it is the finiteness check and a logged value.
        """
        if not params:
            return torch.zeros(())
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf
        if self.accelerator is not None:  # FSDP shards need accelerate's distributed norm
            norm = self.accelerator.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):  # sharded parameters: the global norm, as a plain tensor
            norm = norm.full_tensor()
        return norm.detach()

    def _sync_context(self, closes_group: bool) -> contextlib.AbstractContextManager:
        """No gradient all-reduce on micro-batches that do not close a group."""
        if closes_group:
            return contextlib.nullcontext()
        if is_sharded(self.model):
            return no_gradient_sync(self.model)
        if self.accelerator is not None:
            return self.accelerator.no_sync(self.model)
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context ``forward`` runs in (also for evaluation passes outside training)."""
        return self.accelerator.autocast() if self.accelerator is not None else contextlib.nullcontext()


def _length_from_kwargs(length: int | None, kwargs: dict[str, Any] | None) -> int | None:
    if not kwargs:
        return length
    unknown = set(kwargs) - {"length_of_dataloader"}
    if unknown:
        raise ValueError(f"gradient_accumulation_kwargs: unknown keys {sorted(unknown)}; "
                         "only 'length_of_dataloader' is accepted")
    if length is not None and length != kwargs["length_of_dataloader"]:
        raise ValueError("length_of_dataloader given twice with different values")
    return kwargs["length_of_dataloader"]


def _check_accelerator(accelerator: Any, lr_scheduler: Any) -> None:
    if accelerator is None:
        return
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError("TrainStep does not support DeepSpeed (it owns loss scaling, accumulation and "
                         "clipping itself); use DDP or FSDP")
    if accelerator.scaler is not None and accelerator.scaler.is_enabled():
        raise ValueError("the Accelerator has its own enabled fp16 GradScaler, which would scale the loss twice; "
                         "create it with dreamstep.engine.train_step.make_accelerator(...)")
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError("give gradient_accumulation_steps to TrainStep, not to the Accelerator")
    if isinstance(lr_scheduler, AcceleratedScheduler):
        raise TypeError("pass the LR scheduler to TrainStep unprepared (not through accelerator.prepare): "
                         "TrainStep steps it once per optimizer step")


def _default_scaler(accelerator: Any, optimizer: torch.optim.Optimizer | None) -> LossScaler | None:
    """fp16 needs loss scaling; bf16 and fp32 do not."""
    fp16_compute = accelerator is not None and accelerator.mixed_precision == "fp16"
    fp16_params = optimizer is not None and any(p.dtype == torch.float16 for p in _params(optimizer))
    return DynamicLossScaler() if fp16_compute or fp16_params else None


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    for group in optimizer.param_groups:
        yield from group["params"]
