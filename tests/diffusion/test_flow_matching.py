import math

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
