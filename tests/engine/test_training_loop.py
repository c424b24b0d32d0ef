"""run_training: exact resume, non-finite loss handling, callback cadence, logging, progress."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.optimization import get_cosine_schedule_with_warmup
from engine_testkit import RegressionStep, regression_batches, tiny_mlp
from torch.utils.data import DataLoader, TensorDataset

from dreamstep import DynamicLossScaler, TrainStep
from dreamstep.engine.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from dreamstep.engine.logging import TrainingLogger
from dreamstep.engine.loop import Every, Hook, NonFiniteLossError, epoch_generator, run_training
from dreamstep.errors import UserError


class NoisyStep(TrainStep):
    """Draws from every RNG inside forward, as a diffusion step draws noise and timesteps."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        noise = torch.randn_like(x)  # (B, 4)
        weight = 1 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        loss = weight * F.mse_loss(self.model(x + 0.1 * noise), y)
        return loss


_DATASET = TensorDataset(*(torch.cat(t) for t in zip(*regression_batches(5, 2, seed=3, dtype=torch.float32))))


def _data(kind: str):
    """10 samples in batches of 2 -> 5 batches per epoch, shuffled differently each epoch."""
    if kind == "factory":
        return lambda epoch: DataLoader(_DATASET, batch_size=2, shuffle=True, generator=epoch_generator(7, epoch))
    return DataLoader(_DATASET, batch_size=2, shuffle=True)  # order drawn from the global RNG at iter()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _build(init_seed: int) -> NoisyStep:
    model = tiny_mlp(init_seed, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)
    # window 2: the scale doubles during the run, so its state must be restored too
    return NoisyStep(model, opt, sched, loss_scaler=DynamicLossScaler(2.0**10, 2, 2), max_grad_norm=1.0,
                     gradient_accumulation_steps=2, length_of_dataloader=5)


def _optimizer_tensors(step: TrainStep) -> list[torch.Tensor]:
    return [v for entry in step.optimizer.state_dict()["state"].values() for v in entry.values()]


@pytest.mark.parametrize("kind", ["factory", "global_rng"])
@pytest.mark.parametrize("stop_at", [2, 3], ids=["mid_epoch", "epoch_end"])
def test_resume_is_exact(tmp_path, kind, stop_at):
    """6 steps straight == `stop_at` steps + checkpoint + fresh objects + resume + the rest (accumulation 2,
    3 steps per epoch; AdamW, cosine schedule with warmup, dynamic scaler, RNG in forward, shuffled data)."""
    _seed_everything(0)
    straight = _build(init_seed=0)
    expected = run_training(straight, _data(kind), max_train_steps=6, progress=False)
    expected_next_draw = torch.rand(4)

    _seed_everything(0)
    first = _build(init_seed=0)
    def save(position):
        return save_checkpoint(tmp_path, first, position, first.model.state_dict())
    head = run_training(first, _data(kind), max_train_steps=stop_at, hooks=[Hook(Every(steps=stop_at), save)],
                        progress=False)

    _seed_everything(123)  # a new process: different seed, different init, new optimizer and data objects
    resumed = _build(init_seed=99)
    loaded = load_checkpoint(resolve_resume(tmp_path, "latest"), resumed)
    resumed.model.load_state_dict(loaded.weights)
    tail = run_training(resumed, _data(kind), max_train_steps=6, resume=loaded, progress=False)

    assert head.losses + tail.losses == pytest.approx(expected.losses, abs=1e-6)
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    for a, b in zip(_optimizer_tensors(straight), _optimizer_tensors(resumed), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert resumed.lr_scheduler.state_dict() == straight.lr_scheduler.state_dict()
    assert resumed.state_dict() == straight.state_dict() and resumed.loss_scale > 2.0**10
    assert tail.position == expected.position
    assert torch.equal(torch.rand(4), expected_next_draw)


def test_resume_detects_wrong_data_length(tmp_path):
    step = RegressionStep(tiny_mlp(), torch.optim.SGD(tiny_mlp().parameters(), lr=0.1),
                          gradient_accumulation_steps=2, length_of_dataloader=5)
    with pytest.raises(ValueError, match="length_of_dataloader=5 but an epoch has 4 batches"):
        run_training(step, regression_batches(4, 2), num_epochs=1, progress=False)


def _nan_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = regression_batches(4, batch_size=2)
    batches[1][0][0, 0] = math.nan
    return batches


def test_non_finite_loss_stops_with_the_step_number():
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 2 \\(epoch 0, batch 2\\)") as info:
        run_training(step, _nan_batches(), num_epochs=1, progress=False)
    assert isinstance(info.value, UserError)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_non_finite_loss_read_at_the_logging_cadence_still_names_its_step(tmp_path):
    """Losses are read every 3 steps: the NaN of step 2 stops the run at step 3's read, naming step 2; its
    update (fused AdamW, skipped on the device) was not applied, and the steps before it were logged."""
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    logger = TrainingLogger(tmp_path, report_to="none")
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 2 \\(epoch 0, batch 2\\)"):
        run_training(step, _nan_batches(), num_epochs=1, logger=logger, progress=False, log_every=3)
    assert step.num_updates == 3 and step.num_skipped == 1
    assert [s for s, _ in logger.loss_history] == [1]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_every_step_is_logged_when_losses_are_read_every_few_steps(tmp_path):
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.05))
    logger = TrainingLogger(tmp_path, report_to="none")
    result = run_training(step, regression_batches(7, 2), num_epochs=1, logger=logger, progress=False,
                          log_every=3)
    logger.close()
    assert [s for s, _ in logger.loss_history] == list(range(1, 8))
    assert [v for _, v in logger.loss_history] == result.losses
    lines = [line for line in (tmp_path / "train.log").read_text().splitlines() if " step " in line]
    assert [line.split(" step ")[1].split()[0] for line in lines] == [str(s) for s in range(1, 8)]


def test_non_finite_loss_can_be_skipped(capsys):
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = run_training(step, _nan_batches(), num_epochs=1, on_nonfinite_loss="skip", progress=False)
    assert "warning: loss is nan at step 2 (epoch 0, batch 2); skipping this step" in capsys.readouterr().err
    assert len(result.losses) == 4 and math.isnan(result.losses[1])
    assert result.skipped_steps == [2] and step.num_updates == 4 and step.num_skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_hooks_run_on_their_cadence_in_order_and_logger_gets_scalars(tmp_path):
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = RegressionStep(model, opt, gradient_accumulation_steps=2, length_of_dataloader=7)
    calls = []
    logger = TrainingLogger(tmp_path, report_to="none")
    hooks = [Hook(Every(steps=3), lambda p: calls.append(("sample", p.global_step))),
             Hook(Every(epochs=1), lambda p: calls.append(("save", p.global_step))),
             Hook(Every(steps=4), lambda p: calls.append(("checkpoint", (p.global_step, p.epoch, p.batch_in_epoch)))),
             Hook(Every(), lambda p: calls.append(("never", p.global_step)))]
    result = run_training(step, regression_batches(7, 2), num_epochs=3, hooks=hooks, logger=logger, progress=False)
    assert len(result.losses) == 12  # 4 groups per epoch (2, 2, 2, 1)
    # Epoch ends are steps 4, 8, 12; at a step where several are due they run in the list's order.
    assert calls == [("sample", 3), ("save", 4), ("checkpoint", (4, 0, 7)), ("sample", 6), ("save", 8),
                     ("checkpoint", (8, 1, 7)), ("sample", 9), ("sample", 12), ("save", 12),
                     ("checkpoint", (12, 2, 7))]
    assert [v for _, v in logger.loss_history] == result.losses
    assert set(logger.history) == {"loss", "lr", "grad_norm", "loss_scale", "skipped"}
    assert result.losses[-1] < result.losses[0]


def test_max_train_steps_stops_mid_epoch_and_progress_shows_rate(capsys):
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.05), gradient_accumulation_steps=2,
                          length_of_dataloader=7)
    result = run_training(step, regression_batches(7, 2), max_train_steps=5, progress=True)
    position = result.position
    assert (position.global_step, position.epoch, position.batch_in_epoch) == (5, 1, 2)
    err = capsys.readouterr().err
    assert "5/5" in err and "step/s" in err


class PixelStep(TrainStep):
    """Regresses a scalar onto each batch's mean pixel, with noise drawn in forward."""

    def forward(self, batch: dict) -> tuple[torch.Tensor]:
        target = batch["pixel_values"].mean() + 0.01 * torch.randn(())
        return (self.model.weight.sum() - target) ** 2


def _bucketed_batches(tmp_path, encoded: list):
    """6 images in batches of 1 through a conditioner that records each batch it encodes."""
    from PIL import Image

    from dreamstep.data import ConditionedBatches, build_dataset, dreambooth_from_flags, make_dataloader
    from dreamstep.data.sources import bucket_spec

    folder = tmp_path / "images"
    folder.mkdir(exist_ok=True)
    for i in range(6):
        Image.new("RGB", (32, 32), (40 * i, 0, 0)).save(folder / f"{i}.png")
    dataset = build_dataset([dreambooth_from_flags(folder, "a photo", buckets=bucket_spec(32), random_flip=True)],
                            seed=0)

    def conditioner(batch: dict) -> dict:
        encoded.extend(batch["image_paths"])
        return batch

    return ConditionedBatches(make_dataloader(dataset, seed=0), conditioner)


def _pixel_step() -> PixelStep:
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    return PixelStep(model, torch.optim.SGD(model.parameters(), lr=0.1), length_of_dataloader=6)


def test_resume_leaves_trained_batches_unread_and_unencoded(tmp_path):
    """The bucket sampler skips the batches a checkpoint already trained on: the conditioner (VAE and text
    encoders in a recipe) never sees them, and the resumed run equals the straight one."""
    _seed_everything(0)
    straight_encoded: list = []
    straight = run_training(_pixel_step(), _bucketed_batches(tmp_path, straight_encoded), max_train_steps=4,
                            progress=False)

    _seed_everything(0)
    first = _pixel_step()
    def save(position):
        return save_checkpoint(tmp_path / "ckpt", first, position, first.model.state_dict())
    head = run_training(first, _bucketed_batches(tmp_path, []), max_train_steps=2, hooks=[Hook(Every(steps=2), save)],
                        progress=False)
    _seed_everything(1)
    resumed = _pixel_step()
    loaded = load_checkpoint(resolve_resume(tmp_path / "ckpt", "latest"), resumed)
    resumed.model.load_state_dict(loaded.weights)
    encoded: list = []
    tail = run_training(resumed, _bucketed_batches(tmp_path, encoded), max_train_steps=4, resume=loaded,
                        progress=False)
    assert encoded == straight_encoded[2:4]  # only the batches it trains on, in the straight run's order
    assert head.losses + tail.losses == pytest.approx(straight.losses, abs=1e-7)
