import math

import pytest
import torch

from dreamstep.diffusion.flow_matching import (
    noisy_latents,
    sample_timestep_indices,
    sigmas_at,
    velocity_target,
    weighted_mse,
)


def test_noising_and_target_are_the_rectified_flow_formulas():
    x = torch.tensor([[2.0]])
    eps = torch.tensor([[-1.0]])
    sigma = torch.tensor([[0.25]])
    assert noisy_latents(x, eps, sigma).item() == 0.75 * 2.0 + 0.25 * -1.0
    assert velocity_target(x, eps).item() == -3.0


def test_indices_stay_inside_the_table_for_every_scheme():
    for scheme in ["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"]:
        g = torch.Generator().manual_seed(0)
        idx = sample_timestep_indices(scheme, 4096, 1000, mode_scale=1.29, generator=g)
        assert idx.dtype == torch.long and idx.min() >= 0 and idx.max() <= 999


def test_logit_normal_concentrates_in_the_middle():
    g = torch.Generator().manual_seed(0)
    idx = sample_timestep_indices("logit_normal", 20000, 1000, generator=g).float()
    uniform = sample_timestep_indices("none", 20000, 1000, generator=g).float()
    assert abs(idx.mean().item() - 500) < 15
    assert idx.std() < uniform.std()


def test_sigmas_at_broadcasts_to_latent_rank():
    table = torch.linspace(1.0, 0.001, 1000)
    s = sigmas_at(table, torch.tensor([0, 999]), ndim=4)
    assert s.shape == (2, 1, 1, 1)
    assert s[0].item() == 1.0 and math.isclose(s[1].item(), 0.001, rel_tol=1e-6)


def test_weighted_mse_hand_computed():
    pred = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    target = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    sigmas = torch.tensor([[0.5], [0.25]])
    # per-sample MSE: [(1 + 4) / 2, (4 + 0) / 2] = [2.5, 2.0]
    assert weighted_mse(pred, target, sigmas, "none").tolist() == [2.5, 2.0]
    # sigma_sqrt weights 1/σ²: [4 * 2.5, 16 * 2.0]
    assert weighted_mse(pred, target, sigmas, "sigma_sqrt").tolist() == [10.0, 32.0]
    # cosmap weight 2 / (π (1 - 2σ + 2σ²))
    w = [2 / (math.pi * (1 - 2 * s + 2 * s * s)) for s in (0.5, 0.25)]
    expected = (w[0] * 2.5 + w[1] * 2.0) / 2
    assert math.isclose(weighted_mse(pred, target, sigmas, "cosmap").mean().item(), expected, rel_tol=1e-6)


def test_prior_preservation_weights_each_part_separately():
    from dreamstep.diffusion.flow_matching import instance_plus_prior_loss

    per_sample = torch.tensor([1.0, 3.0, 10.0, 20.0])
    is_reg = torch.tensor([False, False, True, True])
    assert instance_plus_prior_loss(per_sample, is_reg, 0.5).item() == 2.0 + 0.5 * 15.0
    assert instance_plus_prior_loss(per_sample[:2], is_reg[:2], 0.5).item() == 2.0


def test_flux_shift_mu_and_time_shift_are_flux_formulas():
    from dreamstep.diffusion.flow_matching import linear_function, time_shift

    mu = linear_function()
    assert mu(256) == 0.5 and math.isclose(mu(4096), 1.15) and math.isclose(mu(1024), 0.63)
    # time_shift(μ, 1, t) = e^μ / (e^μ + 1/t - 1); at t = 1/2 that is sigmoid(μ)
    assert math.isclose(time_shift(0.63, 1.0, torch.tensor(0.5)).item(), 1 / (1 + math.exp(-0.63)), rel_tol=1e-6)


def test_sd_scripts_samplers_with_the_same_draws():
    from dreamstep.diffusion.flow_matching import sample_sigmas

    def draws(seed: int, kind: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.rand((3,), generator=g) if kind == "rand" else torch.randn((3,), generator=g)

    def sigmas(method: str, **options) -> torch.Tensor:
        return sample_sigmas(method, 3, (64, 32), generator=torch.Generator().manual_seed(7), **options)

    assert torch.equal(sigmas("uniform"), draws(7, "rand"))
    n = draws(7, "randn")
    assert torch.allclose(sigmas("sigmoid", sigmoid_scale=2.0), torch.sigmoid(2.0 * n))
    s = torch.sigmoid(0.5 * n)
    assert torch.allclose(sigmas("shift", sigmoid_scale=0.5, discrete_flow_shift=3.0), 3 * s / (1 + 2 * s))
    # 64x32 latents are 32·16 = 512 packed tokens: μ = 0.5 + 0.65 · (512 - 256) / 3840
    mu = 0.5 + 0.65 * 256 / 3840
    expected = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    assert torch.allclose(sigmas("flux_shift", sigmoid_scale=0.5), expected)


def test_a_half_shifts_to_three_quarters_at_shift_three():
    from dreamstep.diffusion.flow_matching import sample_sigmas

    # sigmoid(0 · n) = 1/2 for any draw: 3 · 0.5 / (1 + 2 · 0.5) = 0.75
    assert sample_sigmas("shift", 2, (8, 8), sigmoid_scale=1e-12).tolist() == pytest.approx([0.75, 0.75])


def test_model_prediction_types_are_sd_scripts_readings():
    from dreamstep.diffusion.flow_matching import apply_model_prediction_type

    out, x_sigma, sigma = torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[0.25]])
    assert apply_model_prediction_type("raw", out, x_sigma, sigma, "sigma_sqrt") == (out, None)
    pred, weighting = apply_model_prediction_type("additive", out, x_sigma, sigma, "sigma_sqrt")
    assert pred.item() == 3.0 and weighting is None
    pred, weighting = apply_model_prediction_type("sigma_scaled", out, x_sigma, sigma, "sigma_sqrt")
    assert pred.item() == 1.0 - 0.25 * 2.0 and weighting.item() == 16.0  # x_σ - σ·out, weighted 1/σ²


def test_the_default_objective_is_diffusers_weighted_mse():
    from dreamstep.diffusion.flow_matching import FlowMatchingObjective

    pred, target = torch.randn(2, 4, 2, 2), torch.randn(2, 4, 2, 2)
    sigmas = torch.tensor([0.5, 0.25]).reshape(2, 1, 1, 1)
    for scheme in ["none", "sigma_sqrt", "cosmap"]:
        per_element = FlowMatchingObjective(weighting_scheme=scheme).per_element_loss(pred, pred, target, sigmas, 1000)
        assert torch.equal(per_element.reshape(2, -1).mean(dim=1), weighted_mse(pred, target, sigmas, scheme))
