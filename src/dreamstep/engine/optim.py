"""Optimizers and learning-rate schedules by name, from the libraries that implement them.

AdamW and Adafactor come with torch/transformers; AdamW8bit and Lion need ``bitsandbytes``; Prodigy
needs ``prodigyopt`` (``pip install dreamstep[optim]``). Names are matched case-insensitively, so
Kohya's ``--optimizer_type AdamW8bit`` and diffusers' ``--optimizer adamw`` both work.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

import torch
from diffusers.optimization import get_scheduler

from dreamstep.config.training import LR_SCHEDULERS
from dreamstep.errors import UserError, did_you_mean

OPTIMIZERS = ("AdamW", "AdamW8bit", "Prodigy", "Lion", "Adafactor")


def parse_optimizer_args(items: Iterable[str], flag: str = "--optimizer_args") -> dict[str, Any]:
    """Kohya's ``key=value`` list (``weight_decay=0.05 betas=0.9,0.98``) as a dict of Python values."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"{flag}: '{item}' is not key=value (e.g. weight_decay=0.05 betas=0.9,0.98)")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        parsed[key.strip()] = value
    return parsed


def _import(package: str, extra: str) -> Any:
    try:
        return __import__(package)
    except ImportError:
        raise UserError(f"--optimizer {extra} needs the '{package}' package; "
                        f"run: pip install {package}  (or pip install 'dreamstep[optim]')") from None


def build_optimizer(name: str, params: Iterable[Any], lr: float, *, betas: tuple[float, float] = (0.9, 0.999),
                    weight_decay: float = 1e-4, eps: float = 1e-8, extra: dict[str, Any] | None = None,
                    flag: str = "--optimizer") -> torch.optim.Optimizer:
    """The optimizer called ``name`` over ``params`` (tensors or param groups); ``extra`` overrides
    any keyword, as Kohya's ``--optimizer_args`` do."""
    canonical = {o.lower(): o for o in OPTIMIZERS}.get(name.lower())
    if canonical is None:
        raise UserError(f"{flag}: unknown optimizer '{name}'{did_you_mean(name, OPTIMIZERS)}; "
                        f"choose one of {', '.join(OPTIMIZERS)}")
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if canonical in ("AdamW", "AdamW8bit", "Prodigy"):
        kwargs.update(betas=betas, eps=eps)
    elif canonical == "Lion":
        kwargs.update(betas=betas)
    kwargs.update(extra or {})
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    params = list(params)
    try:
        if canonical == "AdamW":
            return torch.optim.AdamW(params, **kwargs)
        if canonical == "AdamW8bit":
            return _import("bitsandbytes", canonical).optim.AdamW8bit(params, **kwargs)
        if canonical == "Lion":
            return _import("bitsandbytes", canonical).optim.Lion(params, **kwargs)
        if canonical == "Prodigy":
            return _import("prodigyopt", canonical).Prodigy(params, **kwargs)
        from transformers.optimization import Adafactor

        kwargs.setdefault("relative_step", False)
        kwargs.setdefault("scale_parameter", False)
        return Adafactor(params, **kwargs)
    except TypeError as e:
        raise UserError(f"{flag} {canonical}: bad optimizer argument ({e}); check --optimizer_args") from None


def build_lr_scheduler(name: str, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                       num_cycles: int = 1, power: float = 1.0,
                       flag: str = "--lr_scheduler") -> torch.optim.lr_scheduler.LRScheduler:
    """diffusers' schedule ``name``; the counts are optimizer steps (not micro-batches)."""
    if name not in LR_SCHEDULERS:
        raise UserError(f"{flag}: unknown scheduler '{name}'{did_you_mean(name, LR_SCHEDULERS)}; "
                        f"choose one of {', '.join(LR_SCHEDULERS)}")
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps,
                         num_cycles=num_cycles, power=power)
