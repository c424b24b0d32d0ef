"""AdamW for bf16 weights whose update math is fp32: the memory-saving alternative to the fp32 trainable weights
of :mod:`dreamstep.models.precision`.

That policy keeps trainable weights in fp32 because an optimizer that updates a bf16 weight in bf16 loses the
update: bf16 has 8 significant bits, so ``w - lr * step`` with ``lr * step < |w| / 256`` rounds back to
``w``. :class:`StochasticRoundingAdamW` keeps the weights (and so their gradients) in bf16 but runs torch's
own AdamW on an fp32 copy of one tensor at a time, with fp32 moments, and writes the result back with
stochastic rounding (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision"): the value rounds
up or down at random in proportion to its distance from each neighbour, so the expected stored weight is
the fp32 result and small updates accumulate instead of vanishing.

Trainable state per parameter: 2 (weight) + 2 (gradient) + 8 (fp32 moments) = 12 bytes, against
4 + 4 + 8 = 16 bytes for fp32 weights with AdamW. (An fp32 master copy would cost 2 + 2 + 4 + 8 = 16:
no saving, which is why the rounding is stochastic instead.)

The random bits come from the optimizer's own generator, seeded at construction and saved in its
``state_dict``, so the global RNG stream (noise, timesteps) is the same as with fp32 weights and a resumed
run rounds exactly as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

_MANTISSA_DROPPED = 1 << 16  # fp32 -> bf16 keeps the top 16 of 32 bits
_HIGH_HALF = -(1 << 16)  # 0xFFFF0000 as int32


def stochastic_round_to_bf16(value: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``value`` to bf16 at random: up with probability (value - down) / (up - down).

    Adding a uniform 16-bit integer to the fp32 bit pattern and clearing the low 16 bits carries into the
    kept bits with exactly that probability (for either sign: the pattern is sign and magnitude)."""
    bits = value.float().view(torch.int32)
    noise = torch.randint(0, _MANTISSA_DROPPED, value.shape, dtype=torch.int32, device=value.device,
                          generator=generator)
    rounded = (bits + noise) & _HIGH_HALF
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the dropped bits are zero


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) over bf16 or fp32 parameters, with fp32 moments and fp32 update math;
    bf16 parameters are written back by :func:`stochastic_round_to_bf16`."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.seed = seed
        self._generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None  # restored by load_state_dict, applied lazily

    def _rounding_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
            if self._generator_state is not None:
                self._generator.set_state(self._generator_state)
        return self._generator

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group, beta1, beta2)
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any], beta1: float, beta2: float) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        master = param.float()  # the fp32 copy of this one tensor (``param`` itself when fp32)
        adamw([master], [param.grad.float()], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
              foreach=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        if master is not param:
            param.copy_(stochastic_round_to_bf16(master, self._rounding_generator(param.device)))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._generator is not None:
            state["rounding_generator"] = self._generator.get_state()
        elif self._generator_state is not None:
            state["rounding_generator"] = self._generator_state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, keeping the moments fp32 (torch's loader casts float state to each parameter's dtype)."""
        state_dict = dict(state_dict)
        self._generator_state = state_dict.pop("rounding_generator", None)
        self._generator = None
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.state[params[index]][key] = saved[key].to(device=params[index].device, dtype=torch.float32)


def trainable_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the trainable state: the optimizer's parameters, their gradients (a gradient has its
    parameter's dtype and shape, and lives from backward to the step) and the optimizer's state tensors."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    weights = sum(p.numel() * p.element_size() for p in params)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"weights": weights, "gradients": weights, "optimizer": state, "total": 2 * weights + state}
