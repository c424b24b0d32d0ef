"""Optimizers and learning-rate schedules by name, from the libraries that implement them.

AdamW and Adafactor come with torch/transformers; AdamW8bit and Lion need ``bitsandbytes``; Prodigy
needs ``prodigyopt`` (``pip install dreamstep[optim]``). Names are matched case-insensitively, so
Kohya's ``--optimizer_type AdamW8bit`` and diffusers' ``--optimizer adamw`` both work.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any, Literal

import torch

from dreamstep.config.schema import parse_key_values
from dreamstep.config.training import LR_SCHEDULERS
from dreamstep.errors import UserError, did_you_mean

OPTIMIZERS = ("AdamW", "AdamW8bit", "Prodigy", "Lion", "Adafactor")
FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where dreamstep gives AdamW torch's fused kernel (measured there)


def parse_optimizer_args(items: Iterable[str], flag: str = "--optimizer_args") -> dict[str, Any]:
    """Kohya's ``key=value`` list (``weight_decay=0.05 betas=0.9,0.98``) as a dict of Python values."""
    parsed: dict[str, Any] = {}
    for key, text in parse_key_values(items, flag, "weight_decay=0.05 betas=0.9,0.98").items():
        try:
            parsed[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parsed[key] = text
    return parsed


def _import(package: str, extra: str) -> Any:
    try:
        return __import__(package)
    except ImportError:
        raise UserError(f"--optimizer {extra} needs the '{package}' package; "
                        f"run: pip install {package}  (or pip install 'dreamstep[optim]')") from None


Family = Literal["diffusers", "sd-scripts"]


def canonical_optimizer(name: str, flag: str = "--optimizer") -> str:
    """The optimizer's name as :data:`OPTIMIZERS` spells it (matched case-insensitively)."""
    canonical = {o.lower(): o for o in OPTIMIZERS}.get(name.lower())
    if canonical is None:
        raise UserError(f"{flag}: unknown optimizer '{name}'{did_you_mean(name, OPTIMIZERS)}; "
                        f"choose one of {', '.join(OPTIMIZERS)}")
    return canonical


def optimizer_kwargs(canonical: str, lr: float, family: Family, *, betas: tuple[float, float], weight_decay: float,
                     eps: float, extra: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments the reference scripts give each optimizer. diffusers' scripts pass their
    --adam_* flags to every optimizer. sd-scripts passes only --optimizer_args, so each optimizer keeps its
    library's defaults (weight decay 0.01 for AdamW and AdamW8bit, none for Lion, Prodigy and Adafactor;
    Lion's betas 0.9, 0.99), and Adafactor uses its relative step (no learning rate) unless
    ``relative_step=False`` is given."""
    if family == "sd-scripts":
        kwargs: dict[str, Any] = {"lr": lr, **(extra or {})}
        if canonical == "Adafactor":
            kwargs.setdefault("relative_step", True)
            if kwargs["relative_step"] or kwargs.get("warmup_init"):
                kwargs.update(relative_step=True, lr=None)
    else:
        kwargs = {"lr": lr, "weight_decay": weight_decay}
        if canonical in ("AdamW", "AdamW8bit", "Prodigy"):
            kwargs.update(betas=betas, eps=eps)
        elif canonical == "Lion":
            kwargs.update(betas=betas)
        elif canonical == "Adafactor":
            kwargs.update(relative_step=False, scale_parameter=False)
        kwargs.update(extra or {})
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def build_optimizer(name: str, params: Iterable[Any], lr: float, *, betas: tuple[float, float] = (0.9, 0.999),
                    weight_decay: float = 1e-4, eps: float = 1e-8, extra: dict[str, Any] | None = None,
                    flag: str = "--optimizer", family: Family = "diffusers") -> torch.optim.Optimizer:
    """The optimizer called ``name`` over ``params`` (tensors or param groups), with the keyword defaults of
    ``family``'s scripts (see :func:`optimizer_kwargs`); ``extra`` overrides any keyword, as Kohya's
    ``--optimizer_args`` do. An Adafactor with relative step takes no learning rate, so groups lose theirs."""
    canonical = canonical_optimizer(name, flag)
    kwargs = optimizer_kwargs(canonical, lr, family, betas=betas, weight_decay=weight_decay, eps=eps, extra=extra)
    params = [dict(p, params=_group_tensors(p["params"])) if isinstance(p, dict) else p for p in params]
    if kwargs.get("lr", lr) is None:
        params = [{k: v for k, v in p.items() if k != "lr"} if isinstance(p, dict) else p for p in params]
    try:
        if canonical == "AdamW":
            return torch.optim.AdamW(params, **_with_fused_kernel(params, kwargs))
        if canonical == "AdamW8bit":
            return _import("bitsandbytes", canonical).optim.AdamW8bit(params, **kwargs)
        if canonical == "Lion":
            return _import("bitsandbytes", canonical).optim.Lion(params, **kwargs)
        if canonical == "Prodigy":
            return _import("prodigyopt", canonical).Prodigy(params, **kwargs)
        from transformers.optimization import Adafactor  # seconds to import: not before the run needs it

        return Adafactor(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise UserError(f"{flag} {canonical}: bad optimizer argument ({e}); check --optimizer_args") from None


def _with_fused_kernel(params: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch's fused AdamW (one kernel over every tensor) unless the user chose ``fused`` or ``foreach`` (or
    ``differentiable``, which the fused kernel lacks), or a parameter is not a floating tensor on a CPU or
    CUDA device. ``benchmarks/optimizer_step.py`` measures it: on a CPU, over FLUX.1-dev's rank-16 attention
    LoRA (380 tensors), a fused step took 12-14 ms against 53 ms for the per-tensor loop torch picks there
    and 160 ms for ``foreach``. Only the rounding of the update differs."""
    if {"fused", "foreach", "differentiable"} & kwargs.keys():
        return kwargs
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    fusable = all(t.is_floating_point() and t.device.type in FUSED_ADAMW_DEVICES for t in tensors)
    return {**kwargs, "fused": True} if fusable else kwargs


def _group_tensors(group_params: Any) -> list[torch.Tensor]:
    return [group_params] if isinstance(group_params, torch.Tensor) else list(group_params)


def build_lr_scheduler(name: str, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                       num_cycles: int = 1, power: float = 1.0,
                       flag: str = "--lr_scheduler") -> torch.optim.lr_scheduler.LRScheduler:
    """diffusers' schedule ``name``; the counts are optimizer steps (not micro-batches). An Adafactor with
    relative step sets its own step size: it gets transformers' AdafactorSchedule, as in sd-scripts."""
    if name not in LR_SCHEDULERS:
        raise UserError(f"{flag}: unknown scheduler '{name}'{did_you_mean(name, LR_SCHEDULERS)}; "
                        f"choose one of {', '.join(LR_SCHEDULERS)}")
    from diffusers.optimization import get_scheduler  # seconds to import: not for the checks at the door

    from dreamstep.engine.adafactor import AdafactorStepSizes, is_adafactor

    if is_adafactor(optimizer) and optimizer.defaults["relative_step"]:
        return AdafactorStepSizes(optimizer)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps,
                         num_cycles=num_cycles, power=power)
