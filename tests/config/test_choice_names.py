"""The choice lists the torch-free configs spell out match the libraries that implement them."""

from diffusers.optimization import SchedulerType

from dreamstep.config import sdxl_lora, training
from dreamstep.models.sdxl import plumbing as sdxl


def test_lr_scheduler_names_are_diffusers_names() -> None:
    assert set(training.LR_SCHEDULERS) == {s.value for s in SchedulerType} - {"piecewise_constant"}


def test_sample_sampler_names_are_the_ones_models_sdxl_maps() -> None:
    assert set(sdxl_lora.SAMPLERS) == set(sdxl.SAMPLERS)
