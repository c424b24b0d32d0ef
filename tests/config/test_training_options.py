"""The training options of issue 24 (loss types, timestep sampling, ...) in every trainer that has them: in
``--help`` with their defaults, in the resolved ``config.toml``, and bad combinations refused in one line."""

from __future__ import annotations

import argparse

import pytest

from dreamstep.config.flux_controlnet import FluxControlNetConfig
from dreamstep.config.flux_lora import FluxLoraConfig
from dreamstep.config.schema import add_arguments, build_config, config_to_toml
from dreamstep.config.sdxl_lora import SDXLLoraConfig
from dreamstep.errors import UserError

REQUIRED = {
    FluxLoraConfig: {"pretrained_model_name_or_path": "m", "output_dir": "o", "instance_data_dir": "i",
                     "instance_prompt": "x"},
    FluxControlNetConfig: {"pretrained_model_name_or_path": "m", "output_dir": "o", "train_data_dir": "t"},
    SDXLLoraConfig: {"pretrained_model_name_or_path": "m", "output_dir": "o", "train_data_dir": "t"},
}
LOSS = {"loss_type": "l2", "huber_schedule": "snr", "huber_c": 0.1, "huber_scale": 1.0, "ema_decay": None,
        "ema_update_every": 1, "ema_warmup_power": None, "ema_on_cpu": False, "ema_validation": True}
FLUX = {**LOSS, "timestep_sampling": "sigma", "sigmoid_scale": 1.0, "discrete_flow_shift": 3.0}
SDXL = {**LOSS, "debiased_estimation_loss": False, "ip_noise_gamma": None, "ip_noise_gamma_random_strength": False}
DEFAULTS = {FluxLoraConfig: {**FLUX, "masked_loss": False}, FluxControlNetConfig: FLUX,
            SDXLLoraConfig: {**SDXL, "masked_loss": False}}


def _config(config_class: type, **values):
    return build_config(config_class, {**REQUIRED[config_class], **values})


@pytest.mark.parametrize("config_class", DEFAULTS)
def test_every_option_is_in_help_with_its_default_and_in_the_resolved_toml(config_class: type) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, config_class)
    helps = {action.dest: parser._get_formatter()._expand_help(action) for action in parser._actions}
    toml = config_to_toml(_config(config_class))
    for name, default in DEFAULTS[config_class].items():
        if default is not None:  # a flag that is off until given says so in its help, without "(default: None)"
            assert helps[name].endswith(f"(default: {default})") and f"{name} = " in toml
        assert len(helps[name]) > 30
    changed = {FluxLoraConfig: {"loss_type": "huber", "huber_schedule": "exponential", "timestep_sampling": "shift",
                                "discrete_flow_shift": 2.5, "ema_decay": 0.99, "ema_on_cpu": True},
               FluxControlNetConfig: {"loss_type": "smooth_l1", "huber_schedule": "constant", "huber_c": 0.3,
                                      "ema_decay": 0.9, "ema_update_every": 4, "ema_warmup_power": 0.75},
               SDXLLoraConfig: {"loss_type": "l1", "debiased_estimation_loss": True, "ip_noise_gamma": 0.1}}
    toml = config_to_toml(_config(config_class, **changed[config_class]))
    for name, value in changed[config_class].items():
        assert f'{name} = {value!r}'.replace("'", '"').replace("True", "true") in toml


@pytest.mark.parametrize("config_class, values, message", [
    (FluxLoraConfig, {"loss_type": "huber"}, "--loss_type huber with --huber_schedule snr needs a DDPM schedule's SNR"),
    (FluxControlNetConfig, {"loss_type": "smooth_l1"}, "give --huber_schedule constant or exponential"),
    (FluxLoraConfig, {"huber_c": 0.2}, "--huber_c has no effect with --loss_type l2; remove it"),
    (SDXLLoraConfig, {"loss_type": "l1", "huber_scale": 2.0}, "--huber_scale has no effect with --loss_type l1"),
    (FluxLoraConfig, {"discrete_flow_shift": 2.0},
     "--discrete_flow_shift has no effect with --timestep_sampling sigma"),
    (FluxLoraConfig, {"sigmoid_scale": 2.0, "timestep_sampling": "uniform"},
     "--sigmoid_scale has no effect with --timestep_sampling uniform"),
    (FluxControlNetConfig, {"timestep_sampling": "sigmoid"},  # ControlNet's default weighting is logit_normal
     "--weighting_scheme logit_normal draws σ from the σ table, which --timestep_sampling sigmoid does not use"),
    (SDXLLoraConfig, {"ip_noise_gamma_random_strength": True},
     "--ip_noise_gamma_random_strength needs --ip_noise_gamma"),
    (SDXLLoraConfig, {"debiased_estimation_loss": True, "zero_terminal_snr": True},
     "infinite at the last timestep of --zero_terminal_snr"),
    (FluxLoraConfig, {"ema_on_cpu": True}, "--ema_on_cpu has no effect without --ema_decay"),
    (SDXLLoraConfig, {"ema_update_every": 10}, "--ema_update_every has no effect without --ema_decay"),
    (FluxControlNetConfig, {"ema_decay": 0.99, "zero_stage": 2}, "--ema_decay keeps an average of whole weights"),
])
def test_combinations_that_cannot_work_are_refused(config_class: type, values: dict, message: str) -> None:
    with pytest.raises(UserError) as error:
        _config(config_class, **values)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_options_that_work_together_are_accepted() -> None:
    _config(FluxLoraConfig, loss_type="huber", huber_schedule="exponential", timestep_sampling="shift",
            sigmoid_scale=1.5, discrete_flow_shift=3.1582)
    _config(FluxControlNetConfig, weighting_scheme="none", timestep_sampling="flux_shift")
    _config(SDXLLoraConfig, loss_type="smooth_l1", debiased_estimation_loss=True, zero_terminal_snr=True,
            v_parameterization=True, ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True)
