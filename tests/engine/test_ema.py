"""The EMA of the trained weights equals the closed-form average of the weights it saw, with diffusers' decay
warm-up, on its cadence, on the device or in host memory; it is lent to the model for validation and survives a
checkpoint exactly."""

from __future__ import annotations

import pytest
import torch

from dreamstep.engine.ema import TrainedWithAverage, WeightAverage, validation_weights
from dreamstep.errors import UserError


class Weights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trained = torch.nn.Parameter(torch.zeros(3))
        self.frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)


def _decay(n: int, decay: float, power: float | None) -> float:
    """The decay of the n-th update (1-based), as diffusers' EMAModel.get_decay defines it."""
    k = n - 1
    if k <= 0:
        return 0.0
    warm = 1 - (1 + k) ** -power if power is not None else (1 + k) / (10 + k)
    return min(warm, decay)


def _closed_form(values: list[torch.Tensor], decay: float, power: float | None) -> torch.Tensor:
    """e_N = Σ_n (1 - d_n) Π_{m > n} d_m · w_n: each update's weight in the final average."""
    total = torch.zeros_like(values[0])
    for n, value in enumerate(values, start=1):
        weight = 1 - _decay(n, decay, power)
        for m in range(n + 1, len(values) + 1):
            weight *= _decay(m, decay, power)
        total += weight * value
    return total


@pytest.mark.parametrize("update_every, power, on_cpu", [(1, None, False), (3, None, False), (2, 0.75, True)])
def test_the_average_is_the_closed_form_average_of_the_weights_it_saw(update_every: int, power: float | None,
                                                                      on_cpu: bool) -> None:
    model = Weights()
    average = WeightAverage(model, decay=0.8, update_every=update_every, warmup_power=power, on_cpu=on_cpu)
    seen = []
    for step in range(1, 25):
        with torch.no_grad():
            model.trained.copy_(torch.tensor([step, step**2 / 10, -step], dtype=torch.float32))
        average.update(step)
        if step % update_every == 0:
            seen.append(model.trained.detach().clone())
    (shadow,) = average.average.shadow_params
    assert shadow.device.type == "cpu" and shadow.dtype == torch.float32
    torch.testing.assert_close(shadow, _closed_form(seen, 0.8, power))
    assert [name for name, _ in average.named] == ["trained"]  # frozen weights are not averaged


def test_the_average_is_lent_for_validation_and_the_weights_come_back() -> None:
    model = Weights()
    average = WeightAverage(model, decay=0.5)
    for step, value in enumerate([1.0, 3.0, 5.0], start=1):
        with torch.no_grad():
            model.trained.fill_(value)
        average.update(step)
    expected = _closed_form([torch.full((3,), v) for v in (1.0, 3.0, 5.0)], 0.5, None)
    with validation_weights(average, use=True)():
        torch.testing.assert_close(model.trained.detach(), expected)
    assert model.trained.detach().tolist() == [5.0] * 3
    with validation_weights(average, use=False)():
        assert model.trained.detach().tolist() == [5.0] * 3


def test_a_checkpointed_average_continues_exactly() -> None:
    values = [torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    def run(model: Weights, average: WeightAverage, steps: range) -> None:
        for step in steps:
            with torch.no_grad():
                model.trained.copy_(values[step - 1])
            average.update(step)

    straight_model = Weights()
    straight = WeightAverage(straight_model, decay=0.9, update_every=2)
    run(straight_model, straight, range(1, 9))

    first_model = Weights()
    first = WeightAverage(first_model, decay=0.9, update_every=2)
    run(first_model, first, range(1, 5))
    saved = TrainedWithAverage(first_model, first).state_dict()
    resumed_model = Weights()
    resumed = WeightAverage(resumed_model, decay=0.9, update_every=2)
    TrainedWithAverage(resumed_model, resumed).load_state_dict(saved)
    run(resumed_model, resumed, range(5, 9))
    assert torch.equal(resumed.average.shadow_params[0], straight.average.shadow_params[0])
    assert resumed.average.optimization_step == straight.average.optimization_step == 4

    with pytest.raises(UserError, match="the checkpoint holds no EMA weights"):
        TrainedWithAverage(Weights(), WeightAverage(Weights(), decay=0.9)).load_state_dict(
            Weights().state_dict())


def test_a_run_validates_with_the_average_and_trains_and_saves_the_weights(tmp_path) -> None:
    """With ``RunHooks.validation_weights`` every sample and score of a run (the final one too) sees the EMA,
    which the step updates after every optimizer step; the training weights are untouched by it."""
    from engine_testkit import RegressionStep, flat_params, regression_batches, tiny_mlp

    from dreamstep.engine.fit import RunHooks, finish, fit
    from dreamstep.engine.loop import Every
    from dreamstep.engine.run import start_run

    def run_with(average_for_validation: bool) -> tuple[list[torch.Tensor], torch.Tensor, WeightAverage]:
        run = start_run(tmp_path / f"out-{average_for_validation}", mixed_precision="no", seed=0, report_to="none",
                        resume_from_checkpoint=None, config_toml="", command="dreamstep train test")
        model = tiny_mlp()
        average = WeightAverage(model, decay=0.7)
        step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.05), ema=average)
        seen = []
        hooks = RunHooks(sample=lambda _: seen.append(flat_params(model)) or [], sample_every=Every(2),
                         validation_weights=validation_weights(average, average_for_validation))
        result = fit(run, step, regression_batches(6, batch_size=2), total_steps=5, trained=model, hooks=hooks)
        finish(run, {}, result, hooks)
        return seen, flat_params(model), average

    seen, trained, average = run_with(True)
    plain_seen, plain_trained, _ = run_with(False)
    assert torch.equal(trained, plain_trained)  # validating with the average changes no training step
    shadow = torch.cat([s.flatten() for s in average.average.shadow_params]).to(trained.dtype)
    assert len(seen) == 3 and torch.allclose(seen[-1], shadow)  # steps 2, 4 and the final 5
    assert torch.equal(plain_seen[-1], plain_trained) and not torch.allclose(seen[-1], plain_seen[-1])
