"""Per-element training losses that FLUX and SDXL share, with sd-scripts' names and formulas
(``library/train_util.py``: ``conditional_loss``, ``get_huber_threshold_if_needed``; ``library/
custom_train_functions.py``: ``apply_masked_loss``).

The pseudo-Huber loss with a timestep-scheduled threshold c is from Khrapov et al. 2024, "Improving Diffusion
Models's Data-Corruption Resistance using Scheduled Pseudo-Huber Loss" (arXiv 2403.16728):
``huber``: 2c·(√((p - t)² + c²) - c), ``smooth_l1``: 2·(√((p - t)² + c²) - c).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

LossType = Literal["l2", "l1", "huber", "smooth_l1"]
HuberSchedule = Literal["constant", "exponential", "snr"]


def huber_threshold(schedule: HuberSchedule, huber_c: float, huber_scale: float, timesteps: torch.Tensor,
                    num_train_timesteps: int, alphas_cumprod: torch.Tensor | None = None) -> torch.Tensor:
    """The pseudo-Huber threshold c of each sample, (B,), float32 (sd-scripts' ``get_huber_threshold_if_needed``):

    - ``constant``: c = huber_c·huber_scale;
    - ``exponential``: c = huber_scale·exp(-α·t) with α = -ln(huber_c) / T, so c goes from huber_scale at t = 0
      to huber_c·huber_scale at t = T (FLUX's t is σ·T);
    - ``snr``: c = (1 - huber_c) / (1 + σ_t)² + huber_c with σ_t = √((1 - ᾱ_t) / ᾱ_t), a DDPM schedule's noise
      to signal ratio (``alphas_cumprod`` is needed; huber_scale is not used, as in sd-scripts).
    """
    timesteps = timesteps.float()
    if schedule == "constant":
        return torch.full(timesteps.shape, huber_c * huber_scale, device=timesteps.device)
    if schedule == "exponential":
        alpha = -math.log(huber_c) / num_train_timesteps
        return torch.exp(-alpha * timesteps) * huber_scale
    if alphas_cumprod is None:
        raise ValueError("the snr Huber schedule needs a DDPM schedule's alphas_cumprod")
    alpha_bar = alphas_cumprod.float().to(timesteps.device)[timesteps.long()]
    noise_to_signal = ((1.0 - alpha_bar) / alpha_bar) ** 0.5
    return (1 - huber_c) / (1 + noise_to_signal) ** 2 + huber_c


def conditional_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: LossType,
                     huber_c: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of each element (no reduction), in the inputs' dtype (sd-scripts' ``conditional_loss`` with
    ``reduction="none"``); ``huber_c`` (B,) is the threshold of each sample for ``huber`` and ``smooth_l1``."""
    if loss_type == "l2":
        return F.mse_loss(prediction, target, reduction="none")
    if loss_type == "l1":
        return F.l1_loss(prediction, target, reduction="none")
    if huber_c is None:
        raise ValueError(f"the {loss_type} loss needs a threshold huber_c")
    c = huber_c.reshape(-1, *([1] * (prediction.ndim - 1)))
    pseudo_huber = torch.sqrt((prediction - target) ** 2 + c**2) - c
    return 2 * c * pseudo_huber if loss_type == "huber" else 2 * pseudo_huber


@dataclass(frozen=True)
class LossFunction:
    """The loss a trainer scores its prediction with: ``--loss_type`` with its Huber threshold schedule."""

    loss_type: LossType = "l2"
    huber_schedule: HuberSchedule = "snr"
    huber_c: float = 0.1
    huber_scale: float = 1.0

    def per_element(self, prediction: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor,
                    num_train_timesteps: int, alphas_cumprod: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 loss of each element; ``timesteps`` (B,) place each sample on the Huber schedule."""
        threshold = None
        if self.loss_type in ("huber", "smooth_l1"):
            threshold = huber_threshold(self.huber_schedule, self.huber_c, self.huber_scale, timesteps,
                                        num_train_timesteps, alphas_cumprod).to(prediction.device)
        return conditional_loss(prediction.float(), target.float(), self.loss_type, threshold)


def masked(per_element: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The loss with each latent element weighted by the mask over it (sd-scripts' ``apply_masked_loss``): the
    mask (B, 1, H, W) in [0, 1], at the image's size, is area-averaged down to the loss's (B, C, h, w), so a
    black (0) region contributes nothing; the mean stays over all elements, as in sd-scripts."""
    weight = F.interpolate(mask.to(per_element.dtype), size=per_element.shape[2:], mode="area")
    return per_element * weight
