"""transformers' Adafactor with relative step, as sd-scripts schedules it (imported by
:func:`dreamstep.engine.optim.build_lr_scheduler` only when a run builds its scheduler: transformers' optimization
module takes seconds to import)."""

from __future__ import annotations

import torch
from transformers.optimization import Adafactor, AdafactorSchedule


def is_adafactor(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, Adafactor)


class AdafactorStepSizes(AdafactorSchedule):
    """transformers' proxy schedule for an Adafactor with relative step: it reports the step size Adafactor
    computed for each group (for the logs). transformers' own ``get_lr`` leaves out the groups whose first
    parameter got no gradient this step (a LoRA module dropped by ``module_dropout``), and torch's schedulers
    refuse a list shorter than the groups; here such a group keeps its last value."""

    def get_lr(self) -> list[float]:
        optimizer = self.optimizer
        last = getattr(self, "_last_lr", self.base_lrs)
        sizes = []
        for group, before in zip(optimizer.param_groups, last):
            state = optimizer.state.get(group["params"][0], {})
            sizes.append(optimizer._get_lr(group, state) if "step" in state else before)
        return sizes
