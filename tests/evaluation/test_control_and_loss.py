"""Edge agreement of ControlNet samples, and the deterministic validation loss."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from dreamstep.evaluation.control import edge_agreement, mean_edge_agreement
from dreamstep.evaluation.validation_loss import ValidationLoss, fixed_fractions


def _square(offset: int, outline: bool) -> Image.Image:
    image = Image.new("RGB", (48, 48), "black" if outline else (30, 60, 160))
    box = [8 + offset, 8 + offset, 32 + offset, 32 + offset]
    if outline:
        ImageDraw.Draw(image).rectangle(box, outline="white", width=1)
    else:
        ImageDraw.Draw(image).rectangle(box, fill=(220, 40, 40))
    return image


def test_edges_agree_where_the_sample_follows_the_control() -> None:
    control = _square(0, outline=True)
    following, shifted = _square(0, outline=False), _square(10, outline=False)
    blank = Image.new("RGB", (48, 48), "grey")
    assert edge_agreement(following, control) > 0.6
    assert edge_agreement(shifted, control) < 0.2
    assert edge_agreement(blank, control) == 0.0
    assert 0.0 <= mean_edge_agreement([following, shifted], [control, control]) <= 1.0


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.dropout = torch.nn.Dropout(0.5)

    def loss_at(self, batch: dict, latents: torch.Tensor, noise: torch.Tensor, fraction: float) -> torch.Tensor:
        prediction = self.dropout(self.scale * (noise - latents))  # exact at scale 1
        return fraction * ((prediction - (noise - latents)) ** 2).flatten(1).mean(1)


def _batches() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [{"latent_dist": torch.randn(2, 8, 4, 4, generator=generator)} for _ in range(2)]


def test_validation_loss_is_a_function_of_the_weights_alone() -> None:
    model = _Toy().train()
    loss = ValidationLoss(_batches(), model.loss_at, seed=3, modules=[model])
    rng = torch.get_rng_state()
    first, second = loss(), loss()
    assert first == second  # dropout off, fixed noise and σ
    assert torch.equal(torch.get_rng_state(), rng)  # the training RNG is untouched
    assert model.training  # the module's mode is restored
    assert ValidationLoss(_batches(), model.loss_at, seed=3, modules=[model])() == first
    assert ValidationLoss(_batches(), model.loss_at, seed=4, modules=[model])() != pytest.approx(first)
    with torch.no_grad():
        model.scale.fill_(0.9)  # closer to the target v = ε - x
    assert loss() < first
    assert fixed_fractions(4) == [0.125, 0.375, 0.625, 0.875]
