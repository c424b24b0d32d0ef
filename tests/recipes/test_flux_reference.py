"""The FLUX trainers follow diffusers' reference scripts where no seed says otherwise: their defaults,
and prior preservation as ``train_dreambooth_lora_flux.py`` batches it."""

from __future__ import annotations

import argparse

import pytest
from torch import nn

from dreamstep.config.schema import build_config
from dreamstep.recipes import flux_controlnet, flux_lora


def _lora_config(**values) -> flux_lora.FluxLoraConfig:
    return build_config(flux_lora.FluxLoraConfig, {"pretrained_model_name_or_path": "unused", "output_dir": "unused",
                                                   "instance_data_dir": "unused", "instance_prompt": "x", **values})


def test_flux_lora_text_encoder_group_has_diffusers_learning_rate_and_weight_decay() -> None:
    config = _lora_config(train_text_encoder=True)
    transformer, text_encoder = nn.Linear(2, 2), nn.Linear(2, 2)
    main, text = flux_lora.optimizer_groups(config, transformer, text_encoder)
    assert (main["lr"], main["weight_decay"]) == (1e-4, 1e-4)
    assert (text["lr"], text["weight_decay"]) == (5e-6, 1e-3)
    assert text["params"] == list(text_encoder.parameters())


def test_flux_controlnet_defaults_are_diffusers_controlnet_defaults() -> None:
    config = build_config(flux_controlnet.FluxControlNetConfig, {
        "pretrained_model_name_or_path": "unused", "output_dir": "unused", "train_data_dir": "unused"})
    assert (config.learning_rate, config.adam_weight_decay, config.weighting_scheme) == (5e-6, 1e-2, "logit_normal")
    assert (_lora_config().learning_rate, _lora_config().weighting_scheme) == (1e-4, "none")


@pytest.mark.parametrize("module", [flux_lora, flux_controlnet])
def test_help_says_where_differing_defaults_come_from(module, capsys) -> None:
    parser = argparse.ArgumentParser()
    module.configure_parser(parser, ())
    text = " ".join(parser.format_help().split())
    assert "diffusers' ControlNet default" in text if module is flux_controlnet else "diffusers' default" in text
