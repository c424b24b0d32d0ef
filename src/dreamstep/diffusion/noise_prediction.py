"""DDPM noise-prediction training math for SDXL (ε- and v-prediction), with sd-scripts' loss options.

With clean latents x₀, noise ε and a timestep t of a DDPM schedule with cumulative product ᾱ_t:
x_t = √ᾱ_t·x₀ + √(1-ᾱ_t)·ε, and the model predicts ε, or v = √ᾱ_t·ε - √(1-ᾱ_t)·x₀ (Salimans & Ho 2022,
"Progressive Distillation", §4). Noising and the v target come from diffusers' ``DDPMScheduler``; this
module adds the pieces sd-scripts trains with:

- min-SNR-γ loss weighting (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting");
- offset noise (Guttenberg 2023, "Diffusion with Offset Noise") and sd-scripts' adaptive scale;
- multi-resolution ("pyramid") noise (Whitaker 2023, "Multi-Resolution Noise for Diffusion Model Training");
- input perturbation (Ning et al. 2023, "Input Perturbation Reduces Exposure Bias in Diffusion Models");
- debiased estimation loss weighting (Yu et al. 2024, "Debias the Training of Diffusion Models").
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler

PredictionType = Literal["epsilon", "v_prediction"]


def training_scheduler(scheduler_config: dict, zero_terminal_snr: bool = False) -> DDPMScheduler:
    """The DDPM schedule of the base model (SDXL: 1000 steps, scaled-linear β 0.00085..0.012), as sd-scripts
    trains with it (``clip_sample=False``). ``zero_terminal_snr`` rescales β so that ᾱ_T = 0 while ᾱ_1 is
    kept (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed", Algorithm 1),
    sd-scripts' ``--zero_terminal_snr``."""
    config = {k: v for k, v in dict(scheduler_config).items() if not k.startswith("_")}
    return DDPMScheduler.from_config({**config, "clip_sample": False, "rescale_betas_zero_snr": zero_terminal_snr})


def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ᾱ_t / (1 - ᾱ_t) at each timestep, shape (B,), float32."""
    alpha = alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alpha / (1.0 - alpha)


def min_snr_weight(snr_values: torch.Tensor, gamma: float, v_prediction: bool = False) -> torch.Tensor:
    """Per-sample loss weight min(SNR, γ) / SNR for ε-prediction, min(SNR, γ) / (SNR + 1) for v-prediction
    (the v loss already carries a factor SNR + 1 relative to the ε loss)."""
    clipped = torch.clamp(snr_values, max=gamma)
    if v_prediction:
        return clipped / (snr_values + 1.0)
    # At SNR 0 (the last step of a zero-terminal-SNR schedule) the ratio's limit is 1, not 0/0.
    return torch.where(snr_values > 0, clipped / snr_values, torch.ones_like(snr_values))


def debiased_estimation_weight(snr_values: torch.Tensor, v_prediction: bool = False) -> torch.Tensor:
    """Per-sample loss weight 1/√SNR for ε-prediction, 1/(SNR + 1) for v-prediction, with SNR capped at 1000
    (it is infinite at t = 0), as sd-scripts' ``apply_debiased_estimation``."""
    capped = torch.clamp(snr_values, max=1000.0)
    return 1.0 / (capped + 1.0) if v_prediction else 1.0 / torch.sqrt(capped)


def input_perturbation(noise: torch.Tensor, gamma: float, random_strength: bool = False) -> torch.Tensor:
    """The noise the model's input is made with: ε + γ·ξ, ξ ~ N(0, 1) (the target stays ε); with
    ``random_strength`` γ is drawn from U(0, gamma) once per batch (sd-scripts' ``--ip_noise_gamma``,
    ``--ip_noise_gamma_random_strength``)."""
    strength: float | torch.Tensor = gamma
    if random_strength:
        strength = torch.rand(1, device=noise.device) * gamma
    return noise + strength * torch.randn_like(noise)


def offset_noise(noise: torch.Tensor, latents: torch.Tensor, offset: float,
                 adaptive_scale: float | None = None) -> torch.Tensor:
    """ε + o·n with one n ~ N(0, 1) per sample and channel, shape (B, C, 1, 1): lets the model learn the
    mean brightness. sd-scripts' adaptive scale raises o per channel by ``adaptive_scale·|mean(x₀)|``
    (clamped at 0 for a negative scale)."""
    strength: float | torch.Tensor = offset
    if adaptive_scale is not None:
        channel_mean = latents.mean(dim=(2, 3), keepdim=True).abs()  # (B, C, 1, 1)
        strength = torch.clamp(offset + adaptive_scale * channel_mean, min=0.0)
    shift = torch.randn(latents.shape[0], latents.shape[1], 1, 1, device=latents.device, dtype=latents.dtype)
    return noise + strength * shift


def pyramid_noise(noise: torch.Tensor, iterations: int, discount: float) -> torch.Tensor:
    """ε plus ``iterations`` coarser noise levels, each upsampled bilinearly and weighted ``discount**i``,
    the size divided by a random factor r ∈ [2, 4) per level (to 1x1 at most); rescaled to unit std."""
    batch, channels, height, width = noise.shape
    out = noise.clone()
    for i in range(iterations):
        r = float(torch.rand(()) * 2 + 2)
        h, w = max(1, int(height / r**i)), max(1, int(width / r**i))
        coarse = torch.randn(batch, channels, h, w, device=noise.device, dtype=noise.dtype)
        out += F.interpolate(coarse, size=(height, width), mode="bilinear") * discount**i
        if h == 1 or w == 1:
            break
    return out / out.std()


def sample_timesteps(batch_size: int, min_timestep: int, max_timestep: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform integer timesteps in [min_timestep, max_timestep), shape (B,), as sd-scripts samples them."""
    return torch.randint(min_timestep, max_timestep, (batch_size,), device=device)


def prediction_target(scheduler: DDPMScheduler, latents: torch.Tensor, noise: torch.Tensor,
                      timesteps: torch.Tensor, prediction_type: PredictionType) -> torch.Tensor:
    """What the UNet should output: ε, or v = √ᾱ_t·ε - √(1-ᾱ_t)·x₀."""
    if prediction_type == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    return noise


def per_sample_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample in fp32, shape (B,)."""
    return F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=tuple(range(1, target.ndim)))
