"""TrainStep against the hand-written reference loop (engine_testkit.reference_train), float64."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_stand_ins import fp16_accelerator_as_on_cuda, on_cuda_with_scaler
from engine_testkit import (
    RegressionStep,
    flat_params,
    max_param_diff,
    reference_train,
    regression_batches,
    tiny_mlp,
)

from dreamstep import DynamicLossScaler, StaticLossScaler, TrainStep


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))


def test_accumulated_micro_batches_equal_one_large_batch():
    """(a) N=4 micro-batches of 3 give the parameters of one batch of 12, step by step."""
    n, micro = 4, regression_batches(12, batch_size=3)
    model, ref = tiny_mlp(), tiny_mlp()
    opt, ref_opt = _adamw(model), _adamw(ref)
    step = RegressionStep(model, opt, _warmup(opt), gradient_accumulation_steps=n, length_of_dataloader=12)
    ref_sched = _warmup(ref_opt)
    group_losses = []
    for i, batch in enumerate(micro):
        loss, pred = step(*batch)
        assert pred.shape == (3, 2)
        assert step.optimizer_stepped == ((i + 1) % n == 0)
        if step.sync_gradients:
            group_losses.append(loss.item())
            ref_losses = reference_train(ref, ref_opt, [micro[i - n + 1:i + 1]], ref_sched)
            assert max_param_diff(model, ref) < 1e-10
            assert loss.item() == pytest.approx(ref_losses[0], abs=1e-12)  # group mean, not loss / N
    assert len(group_losses) == 3 and step.num_updates == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert flat_params(model).abs().sum() != flat_params(tiny_mlp()).abs().sum()  # it did train


def test_running_loss_is_the_mean_of_the_group_so_far():
    micro = regression_batches(2, batch_size=3)
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.0), gradient_accumulation_steps=2,
                          length_of_dataloader=2)
    with torch.no_grad():
        own = [torch.nn.functional.mse_loss(model(x), y).item() for x, y in micro]
    first, _ = step(*micro[0])
    second, _ = step(*micro[1])
    assert first.item() == pytest.approx(own[0], abs=1e-12)
    assert second.item() == pytest.approx((own[0] + own[1]) / 2, abs=1e-12)


def test_short_last_group_steps_and_is_normalised_by_its_real_size():
    """(b) 7 micro-batches, N=3: groups of 3, 3 and 1 -> 3 steps per epoch; the last group is a mean of 1."""
    micro = regression_batches(7, batch_size=2)
    model, ref = tiny_mlp(), tiny_mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    step = RegressionStep(model, opt, gradient_accumulation_steps=3, length_of_dataloader=7)
    groups = [micro[0:3], micro[3:6], micro[6:7]]
    for epoch in range(2):
        stepped = [step(*batch) and step.optimizer_stepped for batch in micro]
        assert stepped == [False, False, True, False, False, True, True], f"epoch {epoch}"
        reference_train(ref, ref_opt, groups)
        assert max_param_diff(model, ref) < 1e-10
    assert step.num_updates == 6


def test_last_group_loss_is_its_own_micro_batch_loss():
    micro = regression_batches(7, batch_size=2)
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.0), gradient_accumulation_steps=3,
                          length_of_dataloader=7)
    for batch in micro:
        loss, _ = step(*batch)
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model(micro[6][0]), micro[6][1]).item()
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def _poison_next_gradient(param: torch.nn.Parameter) -> None:
    """Make the next backward write an inf into ``param.grad`` (a real hook, removed after one use)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        poisoned = grad.clone()
        poisoned.view(-1)[0] = math.inf
        return poisoned
    handle = param.register_hook(hook)


def test_dynamic_scaler_skips_inf_gradient_step_then_training_continues():
    """(c) inf gradient: no optimizer or LR step, scale halves, then training goes on like the reference
    without the poisoned group."""
    micro = regression_batches(8, batch_size=2)
    model, ref = tiny_mlp(), tiny_mlp()
    opt, ref_opt = _adamw(model), _adamw(ref)
    sched, ref_sched = _warmup(opt), _warmup(ref_opt)
    step = RegressionStep(model, opt, sched, loss_scaler=DynamicLossScaler(2.0**16, 2, 2000),
                          gradient_accumulation_steps=2, length_of_dataloader=8)
    for batch in micro[:2]:
        step(*batch)
    assert step.optimizer_stepped and step.loss_scale == 2.0**16
    before, lr_before = flat_params(model).clone(), opt.param_groups[0]["lr"]
    adam_step = opt.state[model[0].weight]["step"].item()

    _poison_next_gradient(model[0].weight)
    for batch in micro[2:4]:
        loss, _ = step(*batch)
    assert step.step_skipped and not step.optimizer_stepped and step.num_skipped == 1
    assert not math.isfinite(step.grad_norm)
    assert math.isfinite(loss.item())  # the loss was fine, only the gradient overflowed
    assert step.loss_scale == 2.0**15
    assert torch.equal(flat_params(model), before)
    assert opt.param_groups[0]["lr"] == lr_before and sched.last_epoch == 1
    assert opt.state[model[0].weight]["step"].item() == adam_step
    assert all(p.grad is None for p in model.parameters())

    for batch in micro[4:]:
        step(*batch)
    assert step.optimizer_stepped and step.num_updates == 4
    reference_train(ref, ref_opt, [micro[0:2], micro[4:6], micro[6:8]], ref_sched)
    assert max_param_diff(model, ref) < 1e-10


def test_fused_adamw_without_scaler_skips_a_non_finite_update_on_the_device():
    """No loss scaler and an optimizer that takes found_inf (fused AdamW, the trainers' default): the update
    of a group with an inf gradient is skipped by the kernel, Adam's step count included, and training
    goes on as the reference without that group; the LR schedule counts the skipped group too."""
    micro = regression_batches(8, batch_size=2)
    model, ref = tiny_mlp(), tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    sched = _warmup(opt)
    step = RegressionStep(model, opt, sched, gradient_accumulation_steps=2, length_of_dataloader=8)
    for batch in micro[:2]:
        step(*batch)
    before, adam_step = flat_params(model).clone(), opt.state[model[0].weight]["step"].item()

    _poison_next_gradient(model[0].weight)
    for batch in micro[2:4]:
        step(*batch)
    assert bool(step.nonfinite_tensor) and step.step_skipped and step.num_skipped == 1
    assert torch.equal(flat_params(model), before)
    assert opt.state[model[0].weight]["step"].item() == adam_step
    assert sched.last_epoch == 2 and not hasattr(opt, "found_inf")

    for batch in micro[4:]:
        step(*batch)
    assert step.optimizer_stepped and step.num_updates == 4 and step.num_skipped == 1
    ref_lrs = iter([opt.param_groups[0]["initial_lr"] * min(1.0, (s + 1) / 3) for s in (0, 2, 3)])
    for group in (micro[0:2], micro[4:6], micro[6:8]):
        for param_group in ref_opt.param_groups:
            param_group["lr"] = next(ref_lrs)
        reference_train(ref, ref_opt, [group])
    assert max_param_diff(model, ref) < 1e-10


def test_static_scaler_skips_non_finite_step_and_keeps_its_scale():
    """(c) documented behaviour: a static scaler never changes its scale, but the step is still skipped."""
    micro = regression_batches(4, batch_size=2)
    model, ref = tiny_mlp(), tiny_mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = RegressionStep(model, opt, loss_scaler=StaticLossScaler(1024.0))
    step(*micro[0])
    _poison_next_gradient(model[2].bias)
    step(*micro[1])
    assert step.step_skipped and step.loss_scale == 1024.0
    step(*micro[2])
    step(*micro[3])
    reference_train(ref, ref_opt, [[micro[0]], [micro[2]], [micro[3]]])
    assert max_param_diff(model, ref) < 1e-10


def test_dynamic_scaler_grows_after_window_backs_off_and_round_trips():
    scaler = DynamicLossScaler(8.0, factor=2, window=2, min_scale=2.0)
    scaler.update(True)
    assert scaler.scale_value == 8.0
    scaler.update(True)
    assert scaler.scale_value == 16.0
    scaler.update(True)
    for _ in range(5):
        scaler.update(False)
    assert scaler.scale_value == 2.0 and scaler.good_steps == 0
    scaler.update(True)
    copy = DynamicLossScaler()
    copy.load_state_dict(scaler.state_dict())
    assert copy.state_dict() == scaler.state_dict() == {"type": "dynamic", "scale": 2.0, "factor": 2.0,
                                                         "window": 2, "min_scale": 2.0, "good_steps": 1}
    with pytest.raises(ValueError, match="'dynamic' scaler, this one is 'static'"):
        StaticLossScaler().load_state_dict(scaler.state_dict())


def test_clipping_bounds_the_global_norm_and_reports_the_pre_clip_norm():
    """(d) SGD with lr=1: the update is minus the clipped gradient, so its norm is the clipped norm."""
    x, y = regression_batches(1, batch_size=4)[0]
    y = y * 100  # large errors -> a gradient norm well above the limit
    probe = tiny_mlp()
    torch.nn.functional.mse_loss(probe(x), y).backward()
    true_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in probe.parameters()])).item()
    assert true_norm > 10

    for limit, expected_update in ((0.5, 0.5), (10 * true_norm, true_norm)):
        model = tiny_mlp()
        step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=1.0), max_grad_norm=limit)
        before = flat_params(model).clone()
        step(x, y)
        update = torch.linalg.vector_norm(flat_params(model) - before).item()
        assert step.grad_norm == pytest.approx(true_norm, rel=1e-12)
        assert update <= limit
        assert update == pytest.approx(expected_update, rel=1e-6)  # torch divides by (norm + 1e-6)


def test_reported_norm_is_unscaled_and_per_group():
    micro = regression_batches(2, batch_size=2)
    probe = tiny_mlp()
    big_x, big_y = torch.cat([micro[0][0], micro[1][0]]), torch.cat([micro[0][1], micro[1][1]])
    torch.nn.functional.mse_loss(probe(big_x), big_y).backward()
    true_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in probe.parameters()])).item()
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_scaler=DynamicLossScaler(2.0**16, 2, 2000), gradient_accumulation_steps=2,
                          length_of_dataloader=2)
    step(*micro[0])
    assert step.grad_norm is None and not step.sync_gradients
    step(*micro[1])
    assert step.grad_norm == pytest.approx(true_norm, rel=1e-12)


def test_a_forward_that_returns_its_loss_and_extras_trains_as_written():
    """A subclass writes forward alone and returns its plain loss with extras; the step scales it, accumulates
    over the epoch's groups (3 micro-batches: a group of 2, then one of 1) and clips."""
    class TrainStepForMyNet(TrainStep):
        def forward(self, x):
            y = self.model(x)
            return torch.sum(y), y

    model = torch.nn.Linear(10, 10)
    optim = torch.optim.AdamW(model.parameters())

    train_step = TrainStepForMyNet(
        model,
        optim,
        loss_scaler=DynamicLossScaler(2.0**16, 2, 2000),
        max_grad_norm=1.0,
        gradient_accumulation_steps=2,
        gradient_accumulation_kwargs={"length_of_dataloader": 3}
    )

    stepped = []
    for epoch in range(2):
        for batch in range(3):
            inputs = torch.randn(8, 10)
            outputs = train_step(inputs)
            stepped.append(train_step.optimizer_stepped)
            loss, y = outputs
            assert y.shape == (8, 10) and loss.shape == ()
            assert train_step.grad_norm is None or train_step.grad_norm > 1.0  # sum-loss gradients get clipped
    assert stepped == [False, True, True, False, True, True]
    assert train_step.loss_scale == 2.0**16 and train_step.num_skipped == 0


def test_the_step_scales_a_bare_loss_and_reports_it_unscaled():
    class Bare(TrainStep):
        def forward(self, x):
            return self.model(x).sum()

    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    step = Bare(model, torch.optim.SGD(model.parameters(), lr=0.5), loss_scaler=StaticLossScaler(2.0**10))
    (loss,) = step(torch.ones(1, 2))
    assert loss.item() == 2.0  # the loss forward returned, not 2**10 times it
    assert model.weight.tolist() == [[0.5, 0.5]]  # the gradient (1, 1) unscaled before SGD's step of 0.5


class SeedSpellingStep(TrainStep):
    """mindone's contract: forward scales its loss itself and returns the scaled loss."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.model(x)
        return self.scale_loss(torch.nn.functional.mse_loss(pred, y)), pred


@pytest.mark.parametrize("step_class", [RegressionStep, SeedSpellingStep])
def test_both_spellings_of_forward_scale_once_and_match_one_large_batch(step_class: type[TrainStep]) -> None:
    """SGD (a double scale would shrink the update by N, which AdamW hides); a static scale on top. The second
    epoch has a short last group (5 micro-batches in groups of 2, 2, 1)."""
    n, micro = 2, regression_batches(5, batch_size=2)
    model, ref = tiny_mlp(), tiny_mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = step_class(model, opt, loss_scaler=StaticLossScaler(2.0**8), gradient_accumulation_steps=n,
                      length_of_dataloader=5)
    groups = [micro[0:2], micro[2:4], micro[4:5]]
    for group in groups:
        for batch in group:
            loss, _ = step(*batch)
        (ref_loss,) = reference_train(ref, ref_opt, [group])
        assert max_param_diff(model, ref) < 1e-10
        assert loss.item() == pytest.approx(ref_loss, abs=1e-12)


def test_constructor_rejects_accumulation_without_length_and_bad_values():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="length_of_dataloader is required"):
        RegressionStep(model, opt, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="unknown keys \\['drop_last'\\]"):
        RegressionStep(model, opt, gradient_accumulation_steps=2, gradient_accumulation_kwargs={"drop_last": 1})
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        RegressionStep(model, opt, max_grad_norm=0.0)


def test_fp16_parameters_get_the_dynamic_scaler_by_default():
    half = torch.nn.Linear(2, 2).half()
    assert isinstance(RegressionStep(half, torch.optim.SGD(half.parameters(), lr=0.1)).loss_scaler,
                      DynamicLossScaler)
    full = tiny_mlp()
    assert RegressionStep(full, torch.optim.SGD(full.parameters(), lr=0.1)).loss_scaler is None


def test_fp16_parameters_overflow_backs_off_but_the_loss_stays_finite():
    """Half-precision weights (Kohya's --full_fp16): scaled gradients overflow fp16 at first, the dynamic
    scaler halves the scale until they fit, and the reported loss is never the overflowed value."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).half()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    losses = []
    for x, y in regression_batches(12, batch_size=8, dtype=torch.float16):
        loss, _ = step(x, y * 30)  # loss ~ 900: 900 * 2**16 does not fit in fp16 (max 65504)
        losses.append(loss.item())
    assert all(math.isfinite(v) and v > 100 for v in losses)
    assert step.num_skipped >= 1 and step.loss_scale < 2.0**16
    assert step.optimizer_stepped and all(torch.isfinite(p).all() for p in model.parameters())


def test_state_dict_round_trip_and_refused_mid_group():
    micro = regression_batches(3, batch_size=2)
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_scaler=DynamicLossScaler(4.0, 2, 1),
                          gradient_accumulation_steps=2, length_of_dataloader=3)
    step(*micro[0])
    with pytest.raises(RuntimeError, match="middle of an accumulation group"):
        step.state_dict()
    step(*micro[1])
    state = step.state_dict()
    assert state["micro_step"] == 2 and state["loss_scaler"]["scale"] == 8.0
    other = RegressionStep(tiny_mlp(), torch.optim.SGD(model.parameters(), lr=0.1),
                           loss_scaler=DynamicLossScaler(), gradient_accumulation_steps=2, length_of_dataloader=3)
    other.load_state_dict(state)
    assert other.state_dict() == state and other.at_group_end and other.group_size == 1


def test_fp16_accelerator_scales_once_on_the_cuda_path():
    """accelerate's fp16 path as it runs on a GPU (native fp16 autocast, its own GradScaler built disabled by
    make_accelerator), on the CPU through tests/cuda_stand_ins.py: our dynamic scaler is the only one, the
    forward computes in fp16, training follows the fp32 reference, and an overflow is skipped and backed off."""
    accelerator = fp16_accelerator_as_on_cuda()
    model = tiny_mlp(dtype=torch.float32)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = RegressionStep(model, optimizer, accelerator=accelerator)
    assert isinstance(step.loss_scaler, DynamicLossScaler) and not accelerator.scaler.is_enabled()
    computed = []
    accelerator.unwrap_model(model)[0].register_forward_hook(lambda m, args, out: computed.append(out.dtype))
    ref = tiny_mlp(dtype=torch.float32)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in regression_batches(3, 8, dtype=torch.float32):
        step(x, y)
        reference_train(ref, ref_optimizer, [[(x, y)]])
        assert step.optimizer_stepped
    assert computed == [torch.float16] * 3
    assert step.num_skipped == 0 and step.loss_scale == 2.0**16
    # Scaled twice (or unscaled never), the first step would move the weights 65536 times too far.
    assert max_param_diff(accelerator.unwrap_model(model), ref) < 1e-2
    before = flat_params(accelerator.unwrap_model(model)).clone()
    x, y = regression_batches(1, 8, seed=3, dtype=torch.float32)[0]
    loss, _ = step(x, y * 300)  # gradients * 2**16 overflow fp16 in backward
    assert step.step_skipped and step.loss_scale == 2.0**15 and math.isfinite(loss.item())
    assert torch.equal(flat_params(accelerator.unwrap_model(model)), before)


def test_an_accelerator_with_its_own_enabled_grad_scaler_is_refused_on_the_cuda_path():
    from accelerate import Accelerator

    accelerator = on_cuda_with_scaler(Accelerator(mixed_precision="fp16"))
    assert accelerator.scaler.is_enabled()
    model = tiny_mlp(dtype=torch.float32)
    with pytest.raises(ValueError, match="scale the loss twice"):
        RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accelerator=accelerator)


_FP16_ON_GPU = r"""
import torch
from accelerate import Accelerator
from dreamstep import DynamicLossScaler
from dreamstep.engine.train_step import make_accelerator
from engine_testkit import RegressionStep, max_param_diff, reference_train, regression_batches, tiny_mlp

accelerator = make_accelerator(mixed_precision="fp16")
model = tiny_mlp(dtype=torch.float32)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
step = RegressionStep(model, optimizer, accelerator=accelerator)
assert isinstance(step.loss_scaler, DynamicLossScaler)
ref = tiny_mlp(dtype=torch.float32).cuda()
ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
for x, y in regression_batches(3, 8, dtype=torch.float32):
    step(x.cuda(), y.cuda())
    reference_train(ref, ref_optimizer, [[(x.cuda(), y.cuda())]])
assert step.num_skipped == 0 and step.loss_scale == 2.0**16
assert max_param_diff(accelerator.unwrap_model(model), ref) < 1e-2  # fp16 compute vs fp32
try:
    RegressionStep(model, optimizer, accelerator=Accelerator(mixed_precision="fp16"))
except ValueError as e:
    assert "scale the loss twice" in str(e)
else:
    raise AssertionError("an Accelerator with an enabled GradScaler was accepted")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 autocast and accelerate's GradScaler need CUDA")
def test_fp16_accelerator_on_gpu_scales_once():
    """With real fp16 autocast our dynamic scaler is the only one; accelerate's enabled GradScaler is refused.
    Run in a subprocess: accelerate's state is a per-process singleton."""
    proc = subprocess.run([sys.executable, "-c", _FP16_ON_GPU], cwd=Path(__file__).parent, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
