"""Tiny pipelines (built once per test module) and their LoRA key tables."""

from __future__ import annotations

import pytest
from lora_testkit import inference_mode

from dreamstep.lora.formats import model_keys, pipeline_configs
from dreamstep.models.flux.tiny import build_tiny_flux
from dreamstep.models.lora_keys import ModelKeys
from dreamstep.models.sdxl.tiny import build_tiny_sdxl


@pytest.fixture(scope="module")
def flux_pipe():
    return inference_mode(build_tiny_flux(seed=0, guidance_embeds=True))


@pytest.fixture(scope="module")
def flux_keys(flux_pipe) -> ModelKeys:
    return model_keys("flux", pipeline_configs(flux_pipe))


@pytest.fixture(scope="module")
def sdxl_pipe():
    return inference_mode(build_tiny_sdxl(seed=0))


@pytest.fixture(scope="module")
def sdxl_keys(sdxl_pipe) -> ModelKeys:
    return model_keys("sdxl", pipeline_configs(sdxl_pipe))
