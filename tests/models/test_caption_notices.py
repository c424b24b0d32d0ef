"""Training captions that get cut are named once by the run summary; the pipelines' own notices about
them (one per encoded batch, quoting the cut text) are hidden while the trainers encode captions."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from diffusers import FluxPipeline, StableDiffusionXLPipeline

from dreamstep.models.flux import plumbing as flux
from dreamstep.models.sdxl import plumbing as sdxl

LONG_CAPTION = "a photo of a small red toy robot on a wooden table " * 20


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def pipeline_notices(request: pytest.FixtureRequest) -> _Records:
    logger = logging.getLogger(request.param)
    records = _Records()
    logger.addHandler(records)
    yield records
    logger.removeHandler(records)


@pytest.mark.parametrize("pipeline_notices", ["diffusers.pipelines.flux.pipeline_flux"], indirect=True)
def test_flux_caption_encoding_hides_the_cut_notice_that_the_pipeline_gives(tiny_flux_dir: Path,
                                                                            pipeline_notices: _Records) -> None:
    pipeline = FluxPipeline.from_pretrained(tiny_flux_dir)
    pipeline.encode_prompt(prompt=[LONG_CAPTION], prompt_2=[LONG_CAPTION], max_sequence_length=32)
    assert any("was truncated" in m for m in pipeline_notices.messages)
    pipeline_notices.messages.clear()
    flux.encode_prompts(pipeline, [LONG_CAPTION], max_sequence_length=32)
    assert pipeline_notices.messages == []


@pytest.mark.parametrize("pipeline_notices", ["diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl"],
                         indirect=True)
def test_sdxl_caption_encoding_hides_the_cut_notice_that_the_pipeline_gives(tiny_sdxl_dir: Path,
                                                                            pipeline_notices: _Records) -> None:
    pipeline = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    pipeline.encode_prompt(prompt=[LONG_CAPTION], device="cpu", do_classifier_free_guidance=False)
    assert any("was truncated" in m for m in pipeline_notices.messages)
    pipeline_notices.messages.clear()
    sdxl.encode_prompts(pipeline, [LONG_CAPTION])
    assert pipeline_notices.messages == []


def test_diffusers_fluxposembed_deprecation_is_hidden_on_controlnet_commands() -> None:
    """FluxControlNetModel builds diffusers' deprecated FluxPosEmbed: its FutureWarning starts with the class name,
    not with the fragment we hide, so the fragment must be found anywhere in the message."""
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('always'); from dreamstep.notices import hide_known_notices; "
            "hide_known_notices(); from diffusers.models.embeddings import FluxPosEmbed; "
            "FluxPosEmbed(theta=10000, axes_dim=[2, 2, 4]); warnings.warn('another notice', FutureWarning)")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr
    assert "FluxPosEmbed" not in err and "another notice" in err, err
