"""A validation loss that is a function of the weights alone.

The training loss is noisy twice over: every step draws new noise and a new noise level. To compare
checkpoints, the held-out images are scored instead at a fixed grid of noise levels (fractions of the
schedule, ``(i + 0.5) / levels``) with noise drawn from generators seeded by (seed, batch, level), on the
posterior mean of each image's latents, with dropout off. The same weights then give the same number in
every run, resumed runs included, and the training RNG is never touched.

The loss is the plain MSE of the prediction target (no timestep weighting), so runs trained with
different loss weightings compare on one scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dreamstep.models.vae import posterior_mean

# (batch, clean latents (B, C, h, w), noise like the latents, fraction of the schedule in (0, 1)) -> (B,)
LossAt = Callable[[dict[str, Any], torch.Tensor, torch.Tensor, float], torch.Tensor]
DEFAULT_LEVELS = 4


def fixed_fractions(levels: int) -> list[float]:
    """Mid-points of ``levels`` equal slices of (0, 1): 4 -> [0.125, 0.375, 0.625, 0.875]."""
    return [(i + 0.5) / levels for i in range(levels)]


def fixed_noise(shape: Sequence[int], seed: int, batch_index: int, level_index: int) -> torch.Tensor:
    """Standard normal noise that depends only on (seed, batch, level): float32 on the CPU."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + batch_index) * 1009 + level_index)
    return torch.randn(tuple(shape), generator=generator)


class ValidationLoss:
    """Mean per-sample loss of held-out ``batches`` (step inputs with ``latent_dist``) at fixed noise.

    ``loss_at`` computes the unweighted per-sample loss for given latents, noise and schedule fraction;
    ``modules`` are put in eval mode while scoring and restored afterwards.
    """

    def __init__(self, batches: list[dict[str, Any]], loss_at: LossAt, *, seed: int,
                 modules: Sequence[torch.nn.Module] = (), levels: int = DEFAULT_LEVELS):
        if not batches:
            raise ValueError("ValidationLoss needs at least one held-out batch")
        self.batches = batches
        self.loss_at = loss_at
        self.seed = seed
        self.modules = list(modules)
        self.fractions = fixed_fractions(levels)

    @property
    def num_images(self) -> int:
        return sum(len(b["latent_dist"]) for b in self.batches)

    @torch.no_grad()
    def __call__(self) -> float:
        modes = [m.training for m in self.modules]
        for module in self.modules:
            module.eval()
        total, count = 0.0, 0
        try:
            for b, batch in enumerate(self.batches):
                latents = posterior_mean(batch["latent_dist"])
                for level, fraction in enumerate(self.fractions):
                    noise = fixed_noise(latents.shape, self.seed, b, level).to(latents.device, latents.dtype)
                    per_sample = self.loss_at(batch, latents, noise, fraction).float()
                    total += float(per_sample.sum())
                    count += per_sample.numel()
        finally:
            for module, mode in zip(self.modules, modes):
                module.train(mode)
        return total / count
