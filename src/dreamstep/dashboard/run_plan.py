"""The memory plan of a job before it is queued, as its trainer will print it before loading: the same plan
inputs its recipe gives :func:`~dreamstep.models.plans.print_run_plan`, estimated on the meta device from the
run's own base (a local model folder's configs, a tiny model's included; the published configs for a hub id),
for ``--device_memory`` or the card this machine has; and, where it does not fit, the options that would.
No model weights are read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from dreamstep.config.memory import parse_bytes
from dreamstep.dashboard.heavy import import_heavy
from dreamstep.dashboard.job_requests import trainer_recipe

if TYPE_CHECKING:
    from dreamstep.models.plans import RunPlan

__all__ = ["job_plan"]

_LOCK = threading.Lock()  # an estimator moves its meta modules between dtypes and modes: one plan at a time
_ESTIMATORS: OrderedDict[tuple, Any] = OrderedDict()


def plan_inputs(trainer: str, config: Any, check: Any) -> RunPlan:
    """The plan inputs of ``train TRAINER`` with ``config``, from its recipe's own ``plan_inputs``; ``check``: the
    dataset check of its data (a :class:`~dreamstep.dashboard.dataset_check.DatasetCheck`: the trainer's datasets,
    and its BucketDataset, which says whether the loop encodes random crops)."""
    encodes = check.dataset is not None and check.dataset.encodes_in_the_loop()
    run_plan = trainer_recipe(trainer).plan_inputs(config, check.configs, encodes)
    run_plan.check_source()
    return run_plan


def _estimator(run_plan: RunPlan) -> Any:
    """The estimator of a base (its models built once on the meta device), the last few kept."""
    key = (run_plan.family, run_plan.source, run_plan.options.rank, repr(sorted(run_plan.trains.items())))
    if key not in _ESTIMATORS:
        _ESTIMATORS[key] = run_plan.estimator()
        while len(_ESTIMATORS) > 4:
            _ESTIMATORS.popitem(last=False)
    _ESTIMATORS.move_to_end(key)
    return _ESTIMATORS[key]


def job_plan(trainer: str, config: Any, check: Any) -> dict[str, Any]:
    """The plan of a job as JSON (``check``: the dataset check of its data): the trainer's plan text, the peaks,
    the card and whether it fits, and the changes that would make it fit. A mistake in the options raises the
    trainer's UserError."""
    mp = import_heavy("dreamstep.models.memory_plan")
    options_that_fit = import_heavy("dreamstep.models.plans").options_that_fit
    run_plan = plan_inputs(trainer, config, check)
    options, source = run_plan.options, run_plan.source
    memory, card = _card(config.device_memory)
    with _LOCK:
        estimator = _estimator(run_plan)
        plan = estimator(options)
        fits = None if memory is None else mp.fits(plan, memory)
        found = options_that_fit(estimator, options, memory) if fits is False else []
    text = mp.format_plan(plan, memory) + ("\n" + mp.suggestion_lines(found) if fits is False else "")
    busiest = max(plan.phases, key=lambda phase: phase.device_total)
    released = estimator.family.released_name
    return {"base": source or f"the published {released} configs", "card": card, "device_memory": memory,
            "peak": plan.total, "peak_phase": busiest.name, "host_peak": plan.host_total, "fits": fits,
            "would_fit": [{"flags": flags, "peak": p.total} for flags, p in found], "report": text}


def _card(device_memory: str | None) -> tuple[int | None, str]:
    """The memory the plan is checked against and the card it belongs to, in words."""
    from dreamstep.models.memory_plan import detected_device_memory

    if device_memory:
        return parse_bytes(device_memory, "--device_memory"), f"--device_memory {device_memory}"
    memory = detected_device_memory()
    if memory is None:
        return None, "no CUDA card found on this machine: give --device_memory (e.g. 12GB) to check a card"
    import torch

    return memory, f"{torch.cuda.get_device_name()} (detected)"
