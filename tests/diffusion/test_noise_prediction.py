import math

import torch

from dreamstep.diffusion.noise_prediction import (
    min_snr_weight,
    offset_noise,
    per_sample_mse,
    prediction_target,
    pyramid_noise,
    sample_timesteps,
    snr,
    training_scheduler,
)
from dreamstep.models.sdxl.tiny import build_tiny_sdxl

SDXL_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                  "beta_schedule": "scaled_linear", "prediction_type": "epsilon", "steps_offset": 1}


def test_min_snr_weight_matches_hand_computed_values():
    snrs = torch.tensor([0.5, 5.0, 20.0])
    # ε: min(snr, 5) / snr
    torch.testing.assert_close(min_snr_weight(snrs, 5.0), torch.tensor([1.0, 1.0, 0.25]))
    # v: min(snr, 5) / (snr + 1)
    torch.testing.assert_close(min_snr_weight(snrs, 5.0, v_prediction=True),
                               torch.tensor([0.5 / 1.5, 5.0 / 6.0, 5.0 / 21.0]))


def test_snr_follows_the_sdxl_schedule():
    scheduler = training_scheduler(SDXL_SCHEDULER)
    t = torch.tensor([0, 999])
    alpha_0 = (1 - 0.00085)
    values = snr(scheduler.alphas_cumprod, t)
    assert math.isclose(values[0].item(), alpha_0 / (1 - alpha_0), rel_tol=1e-4)
    assert values[1].item() < 0.01  # almost pure noise at the end of the schedule


def test_offset_noise_adds_one_shift_per_sample_and_channel():
    torch.manual_seed(0)
    noise = torch.zeros(2, 4, 8, 8)
    latents = torch.randn(2, 4, 8, 8)
    out = offset_noise(noise, latents, 0.1)
    # the added term is constant over each (sample, channel) plane
    assert torch.allclose(out, out[:, :, :1, :1].expand_as(out))
    assert out.abs().max() > 0


def test_adaptive_noise_scale_raises_the_offset_by_the_channel_mean():
    latents = torch.full((1, 2, 4, 4), 3.0)
    latents[:, 1] = -2.0
    noise = torch.zeros_like(latents)
    torch.manual_seed(0)
    shift = torch.randn(1, 2, 1, 1)
    torch.manual_seed(0)
    out = offset_noise(noise, latents, 0.1, adaptive_scale=0.5)
    strength = torch.tensor([0.1 + 0.5 * 3.0, 0.1 + 0.5 * 2.0]).view(1, 2, 1, 1)
    torch.testing.assert_close(out, (strength * shift).expand_as(out))


def test_negative_adaptive_scale_never_gives_a_negative_offset():
    latents = torch.full((1, 1, 2, 2), 10.0)
    torch.manual_seed(0)
    out = offset_noise(torch.zeros_like(latents), latents, 0.1, adaptive_scale=-1.0)
    assert torch.count_nonzero(out) == 0


def test_pyramid_noise_is_unit_variance_and_spatially_correlated():
    torch.manual_seed(0)
    noise = torch.randn(4, 4, 64, 64)
    out = pyramid_noise(noise.clone(), iterations=6, discount=0.8)
    assert math.isclose(out.std().item(), 1.0, rel_tol=1e-5)
    neighbours = (out[..., 1:] * out[..., :-1]).mean().item()
    assert neighbours > (noise[..., 1:] * noise[..., :-1]).mean().item() + 0.1


def test_timesteps_stay_in_range():
    torch.manual_seed(0)
    t = sample_timesteps(10_000, 100, 200)
    assert t.min() >= 100 and t.max() <= 199 and t.dtype == torch.long


def test_targets_are_noise_or_velocity():
    scheduler = training_scheduler(build_tiny_sdxl().scheduler.config)
    x, eps, t = torch.ones(1, 1, 2, 2), torch.full((1, 1, 2, 2), 2.0), torch.tensor([500])
    assert torch.equal(prediction_target(scheduler, x, eps, t, "epsilon"), eps)
    a = scheduler.alphas_cumprod[500]
    expected = a.sqrt() * eps - (1 - a).sqrt() * x
    torch.testing.assert_close(prediction_target(scheduler, x, eps, t, "v_prediction"), expected)


def test_per_sample_mse_averages_within_each_sample():
    pred = torch.zeros(2, 1, 2, 2)
    target = torch.stack([torch.ones(1, 2, 2), torch.full((1, 2, 2), 2.0)])
    torch.testing.assert_close(per_sample_mse(pred, target), torch.tensor([1.0, 4.0]))


def _zero_terminal_snr_betas(betas: torch.Tensor) -> torch.Tensor:
    """Lin et al. 2024, Algorithm 1, as sd-scripts' --zero_terminal_snr applies it: shift √ᾱ so the last
    is 0, scale so the first is unchanged, back to β."""
    root = (1 - betas).cumprod(0).sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * first / (first - last)
    alphas_bar = root**2
    return 1 - torch.cat([alphas_bar[:1], alphas_bar[1:] / alphas_bar[:-1]])


def test_zero_terminal_snr_rescales_the_schedule_as_sd_scripts():
    plain = training_scheduler(SDXL_SCHEDULER)
    rescaled = training_scheduler(SDXL_SCHEDULER, zero_terminal_snr=True)
    torch.testing.assert_close(rescaled.betas, _zero_terminal_snr_betas(plain.betas))
    assert rescaled.alphas_cumprod[-1] == 0 and rescaled.alphas_cumprod[0] == plain.alphas_cumprod[0]
    # min-SNR weighting stays finite at the zero-SNR step: the ε weight tends to 1, the v weight to 0.
    last = snr(rescaled.alphas_cumprod, torch.tensor([999]))
    assert min_snr_weight(last, 5.0).item() == 1.0 and min_snr_weight(last, 5.0, v_prediction=True).item() == 0.0
