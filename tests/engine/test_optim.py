import importlib.util

import pytest
import torch
from transformers.optimization import AdafactorSchedule

from dreamstep.engine.optim import build_lr_scheduler, build_optimizer, optimizer_kwargs, parse_optimizer_args
from dreamstep.errors import UserError


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


def test_kohya_optimizer_args_parse_to_python_values():
    args = parse_optimizer_args(["weight_decay=0.05", "betas=0.9,0.98", "decouple=True", "mode=fast"])
    assert args == {"weight_decay": 0.05, "betas": (0.9, 0.98), "decouple": True, "mode": "fast"}
    opt = build_optimizer("adamw", _params(), 1e-3, extra=parse_optimizer_args(["weight_decay=0.05", "betas=0.9,0.98"]))
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.05 and group["betas"] == (0.9, 0.98)


def test_bad_optimizer_args_name_the_flag():
    with pytest.raises(UserError, match="--optimizer_args: 'weight_decay' is not key=value"):
        parse_optimizer_args(["weight_decay"])
    with pytest.raises(UserError, match="bad optimizer argument"):
        build_optimizer("AdamW", _params(), 1e-3, extra={"no_such_arg": 1})


def test_unknown_optimizer_and_scheduler_suggest_the_close_name():
    with pytest.raises(UserError, match="did you mean 'AdamW8bit'"):
        build_optimizer("AdamW8bt", _params(), 1e-3)
    opt = build_optimizer("AdamW", _params(), 1e-3)
    with pytest.raises(UserError, match="--lr_scheduler: unknown scheduler 'costant' \\(did you mean 'constant'\\?\\)"):
        build_lr_scheduler("costant", opt, warmup_steps=0, total_steps=10)


def test_warmup_schedule_and_adafactor():
    opt = build_optimizer("Adafactor", _params(), 1e-2)
    sched = build_lr_scheduler("constant_with_warmup", opt, warmup_steps=4, total_steps=10)
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01])


@pytest.mark.skipif(importlib.util.find_spec("prodigyopt") is not None, reason="prodigyopt is installed")
def test_missing_optional_package_says_how_to_install():
    with pytest.raises(UserError, match="pip install prodigyopt"):
        build_optimizer("Prodigy", _params(), 1.0)


def test_sd_scripts_family_keeps_each_optimizers_own_defaults():
    def kwargs(name, extra=None):
        return optimizer_kwargs(name, 1e-3, "sd-scripts", betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8,
                                extra=extra)

    # sd-scripts passes only --optimizer_args: no weight decay or betas of ours reach Lion or Prodigy.
    assert kwargs("Lion") == {"lr": 1e-3} and kwargs("Prodigy") == {"lr": 1e-3}
    assert kwargs("Lion", {"weight_decay": 0.1})["weight_decay"] == 0.1
    assert build_optimizer("AdamW", _params(), 1e-3, family="sd-scripts").param_groups[0]["weight_decay"] == 0.01
    # The diffusers scripts pass their --adam_* flags to every optimizer.
    assert optimizer_kwargs("Lion", 1e-3, "diffusers", betas=(0.9, 0.99), weight_decay=1e-4, eps=1e-8,
                            extra=None) == {"lr": 1e-3, "weight_decay": 1e-4, "betas": (0.9, 0.99)}


def test_sd_scripts_adafactor_takes_its_relative_step_and_schedule():
    params = _params()
    opt = build_optimizer("Adafactor", [{"params": params, "lr": 1e-3}], 1e-3, family="sd-scripts")
    assert opt.defaults["relative_step"] and opt.defaults["lr"] is None and opt.defaults["weight_decay"] == 0.0
    sched = build_lr_scheduler("constant", opt, warmup_steps=0, total_steps=10)
    assert isinstance(sched, AdafactorSchedule)
    before = params[0].detach().clone()
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    sched.step()
    assert not torch.equal(before, params[0]) and sched.get_lr()[0] > 0
    fixed = build_optimizer("Adafactor", _params(), 1e-3, family="sd-scripts", extra={"relative_step": False})
    assert fixed.defaults["lr"] == 1e-3 and not fixed.defaults["relative_step"]


def test_adafactor_schedule_reports_every_group_when_one_got_no_gradient():
    """Module dropout can leave a whole group without gradients in a step; the schedule still gives one step
    size per group (transformers' own skips that group, and torch's scheduler then fails)."""
    unet, text = [torch.nn.Parameter(torch.ones(3))], _params()
    opt = build_optimizer("Adafactor", [{"params": unet}, {"params": text}], 1e-3, family="sd-scripts")
    sched = build_lr_scheduler("constant", opt, warmup_steps=0, total_steps=10)
    for text_trains in (True, False):
        unet[0].grad = torch.ones_like(unet[0])
        text[0].grad = torch.ones_like(text[0]) if text_trains else None
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    # Relative step 1e-2 times each group's parameter scale (its weights' RMS, at least 1e-3): the text group
    # keeps the size of its one step from zeros; the UNet group's second step is scaled by its weights near 1.
    unet_size, text_size = sched.get_last_lr()
    assert text_size == pytest.approx(1e-2 * 1e-3)
    assert unet_size == pytest.approx(1e-2, rel=0.05)



def _weights_after_steps(optimizer_for, steps=5):
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
    optimizer = optimizer_for(({"params": (w for w in weights), "lr": 1e-2},))
    for step in range(steps):
        for w in weights:
            w.grad = torch.sin(w.detach() * (step + 1))
        optimizer.step()
    return optimizer, weights


def test_adamw_uses_torchs_fused_kernel_and_updates_as_the_per_tensor_loop():
    start = _weights_after_steps(lambda groups: torch.optim.SGD(groups, lr=0.0))[1]
    fused, fused_weights = _weights_after_steps(lambda groups: build_optimizer("AdamW", groups, 1e-2))
    loop, loop_weights = _weights_after_steps(lambda groups: torch.optim.AdamW(groups, weight_decay=1e-4,
                                                                               foreach=False))
    assert fused.defaults["fused"] is True and len(fused.param_groups[0]["params"]) == 2
    for ours, reference, before in zip(fused_weights, loop_weights, start):
        assert (ours - before).abs().mean() > 1e-2
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)


def test_adamw_keeps_a_chosen_implementation_and_fuses_only_where_torch_can():
    chosen = build_optimizer("AdamW", _params(), 1e-3, extra={"foreach": True})
    assert chosen.defaults["foreach"] is True and not chosen.defaults["fused"]
    differentiable = build_optimizer("AdamW", _params(), 1e-3, extra={"differentiable": True})
    assert differentiable.defaults["differentiable"] is True and not differentiable.defaults["fused"]
    on_meta = build_optimizer("AdamW", [torch.nn.Parameter(torch.zeros(2, device="meta"))], 1e-3)
    assert not on_meta.defaults["fused"]
