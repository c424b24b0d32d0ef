"""sd-scripts' loss types against values worked out by hand from its formulas (``library/train_util.py``:
``conditional_loss``, ``get_huber_threshold_if_needed``; ``custom_train_functions.apply_masked_loss``)."""

from __future__ import annotations

import math

import pytest
import torch

from dreamstep.diffusion.losses import LossFunction, conditional_loss, huber_threshold, masked

PRED = torch.tensor([[[[1.0, -2.0], [0.5, 0.0]]]])  # (1, 1, 2, 2)
TARGET = torch.zeros_like(PRED)


def test_l2_and_l1_are_the_squared_and_absolute_errors() -> None:
    assert conditional_loss(PRED, TARGET, "l2").flatten().tolist() == [1.0, 4.0, 0.25, 0.0]
    assert conditional_loss(PRED, TARGET, "l1").flatten().tolist() == [1.0, 2.0, 0.5, 0.0]


def test_huber_and_smooth_l1_are_the_pseudo_huber_formulas() -> None:
    c = torch.tensor([0.1])
    # huber: 2c(√(d² + c²) - c); smooth_l1: 2(√(d² + c²) - c), for d = 1, -2, 0.5, 0
    root = [math.sqrt(d * d + 0.01) - 0.1 for d in (1.0, -2.0, 0.5, 0.0)]
    huber = conditional_loss(PRED, TARGET, "huber", c).flatten().tolist()
    smooth = conditional_loss(PRED, TARGET, "smooth_l1", c).flatten().tolist()
    assert huber == pytest.approx([0.2 * r for r in root], rel=1e-6)
    assert smooth == pytest.approx([2 * r for r in root], rel=1e-6)
    assert huber[0] == pytest.approx(0.1809975, rel=1e-6) and huber[3] == 0.0


def test_huber_threshold_schedules() -> None:
    t = torch.tensor([0, 500, 1000])
    assert huber_threshold("constant", 0.1, 2.0, t, 1000).tolist() == pytest.approx([0.2, 0.2, 0.2])
    # exponential: huber_scale · exp(ln(c) · t / T): 1 at t = 0, √c halfway, c at T
    assert huber_threshold("exponential", 0.1, 1.0, t, 1000).tolist() == pytest.approx([1.0, math.sqrt(0.1), 0.1])
    # snr: (1 - c) / (1 + √((1 - ᾱ)/ᾱ))² + c; ᾱ = 0.5 gives (0.9 / 4) + 0.1, ᾱ = 0.8 gives 0.9 / 1.5² + 0.1
    alphas_cumprod = torch.tensor([0.5, 0.8])
    snr = huber_threshold("snr", 0.1, 3.0, torch.tensor([0, 1]), 2, alphas_cumprod)
    assert snr.tolist() == pytest.approx([0.325, 0.5])


def test_loss_function_places_each_sample_on_its_own_threshold() -> None:
    pred, target = torch.ones(2, 1, 1, 1), torch.zeros(2, 1, 1, 1)
    loss = LossFunction("huber", "exponential", 0.1).per_element(pred, target, torch.tensor([0.0, 1000.0]), 1000)
    c = torch.tensor([1.0, 0.1])
    assert loss.flatten().tolist() == pytest.approx((2 * c * (torch.sqrt(1 + c**2) - c)).tolist())


def test_a_black_mask_region_weighs_nothing_and_the_mean_stays_over_all_elements() -> None:
    per_element = torch.ones(1, 2, 2, 2)
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., :2, :] = 1.0  # the top half of the image is white
    mask[..., 2, 0] = 1.0  # one white pixel of a bottom-left 2x2 block: its latent weighs 1/4
    weighted = masked(per_element, mask)
    assert weighted[0, 0].tolist() == [[1.0, 1.0], [0.25, 0.0]]
    assert weighted.mean().item() == pytest.approx(2.25 / 4)
