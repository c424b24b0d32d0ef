"""The bf16-weights mode of `train flux-controlnet`: stochastic rounding, the AdamW whose update math is
fp32, and the trainable-state memory it saves on the tiny ControlNet (measured, not computed)."""

from __future__ import annotations

import copy

import pytest
import torch

from dreamstep.engine.bf16_adamw import StochasticRoundingAdamW, stochastic_round_to_bf16, trainable_state_bytes
from dreamstep.models.flux import controlnet as cn
from dreamstep.models.flux.tiny import build_tiny_flux


def test_rounding_picks_a_neighbour_and_is_unbiased() -> None:
    value = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16, 1 + 2**-7
    rounded = stochastic_round_to_bf16(value, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert (rounded == 1.0 + 2**-7).float().mean().item() == pytest.approx(0.25, abs=0.01)
    negative = stochastic_round_to_bf16(-value, torch.Generator().manual_seed(1)).float()
    assert negative.mean().item() == pytest.approx(-(1.0 + 2**-9), abs=2e-5)
    exact = torch.tensor([0.0, -2.0, 0.15625, 2.0**100])  # already bf16 values: unchanged
    assert torch.equal(stochastic_round_to_bf16(exact).float(), exact)


def test_fp32_parameters_get_exactly_torch_adamw() -> None:
    torch.manual_seed(0)
    ours, reference = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    reference.load_state_dict(ours.state_dict())
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    optimizers = StochasticRoundingAdamW(ours.parameters(), **kwargs), torch.optim.AdamW(reference.parameters(),
                                                                                        **kwargs)
    for _ in range(5):
        x = torch.randn(16, 8)
        for model, optimizer in zip((ours, reference), optimizers):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_updates_below_bf16_resolution_accumulate() -> None:
    """lr·step = 1e-4 is under half a bf16 step at 1.0 (2**-8): plain bf16 AdamW never moves the weight,
    the stochastic rounding moves it by the fp32 amount on average."""
    def train(optimizer_class: type, steps: int = 100) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.ones(20_000, dtype=torch.bfloat16))
        optimizer = optimizer_class([weight], lr=1e-4, weight_decay=0.0)
        for _ in range(steps):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
        return weight.detach().float()

    assert torch.equal(train(torch.optim.AdamW), torch.ones(20_000))
    assert train(StochasticRoundingAdamW).mean().item() == pytest.approx(1.0 - 100 * 1e-4, abs=2e-4)


def _steps(optimizer: StochasticRoundingAdamW, weight: torch.nn.Parameter, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        weight.grad = torch.randn(weight.shape, generator=generator).to(weight.dtype)
        optimizer.step()


def test_state_dict_keeps_fp32_moments_and_resumes_exactly() -> None:
    straight = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16())
    resumed = torch.nn.Parameter(straight.detach().clone())
    optimizer = StochasticRoundingAdamW([straight], lr=1e-3, seed=3)
    _steps(optimizer, straight, 3, seed=10)
    saved_weight, saved_state = straight.detach().clone(), copy.deepcopy(optimizer.state_dict())
    _steps(optimizer, straight, 3, seed=11)

    resumed.data.copy_(saved_weight)
    fresh = StochasticRoundingAdamW([resumed], lr=1e-3, seed=3)
    fresh.load_state_dict(saved_state)
    assert fresh.state[resumed]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(fresh.state[resumed]["exp_avg_sq"], saved_state["state"][0]["exp_avg_sq"])
    _steps(fresh, resumed, 3, seed=11)
    assert torch.equal(resumed, straight)


def test_bf16_weights_save_a_quarter_of_the_trainable_state() -> None:
    """One step on the tiny ControlNet with each mode; the bytes are measured from the live tensors."""
    transformer = build_tiny_flux(seed=0).transformer
    measured = {}
    for dtype, optimizer_class in ((torch.float32, torch.optim.AdamW), (torch.bfloat16, StochasticRoundingAdamW)):
        controlnet = cn.cast(cn.build_from_transformer(transformer, 1, 1), dtype)
        optimizer = optimizer_class(controlnet.parameters(), lr=1e-4)
        for p in controlnet.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        measured[dtype] = trainable_state_bytes(optimizer)
    fp32, bf16 = measured[torch.float32], measured[torch.bfloat16]
    assert bf16["weights"] * 2 == fp32["weights"]
    assert bf16["optimizer"] == pytest.approx(fp32["optimizer"], rel=1e-3)  # fp32 moments in both
    assert bf16["total"] / fp32["total"] == pytest.approx(0.75, abs=0.005)
