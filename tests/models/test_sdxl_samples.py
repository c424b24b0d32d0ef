"""Sample images made from the prompts' embeddings, encoded before the UNet loads (``sample_prompt_embeddings``),
are the images the pipeline makes from the prompts themselves, with the text encoders gone from the pipeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dreamstep.models.loading import load_sdxl
from dreamstep.models.sdxl import plumbing as sdxl


def test_samples_from_cached_embeddings_are_the_samples_of_the_prompts(tiny_sdxl_dir: Path) -> None:
    pipeline = sdxl.assemble_pipeline(load_sdxl(tiny_sdxl_dir))
    prompts = [sdxl.parse_sample_prompt(line, "prompts.txt", (64, 64)) for line in (
        "a red dog --n blurry --s 2 --l 5 --d 7",  # a negative prompt, encoded
        "a blue cat --w 32 --s 2 --ss euler_a",  # none: SDXL's zeros
        "a red dog --n blurry --s 2 --l 1",  # no guidance; the same prompt's embeddings once
    )]
    embeddings = sdxl.sample_prompt_embeddings(pipeline, prompts)
    assert len(embeddings) == 2
    assert not embeddings[("a blue cat", "")]["negative_prompt_embeds"].any()
    for encoder in (pipeline.text_encoder, pipeline.text_encoder_2):
        encoder.to("meta")  # parked where any use fails
    from_embeddings = sdxl.generate_samples(pipeline, prompts, default_sampler="ddim", seed=3, embeddings=embeddings)
    from_prompts = sdxl.generate_samples(sdxl.assemble_pipeline(load_sdxl(tiny_sdxl_dir)), prompts,
                                         default_sampler="ddim", seed=3)
    for cached, encoded in zip(from_embeddings, from_prompts, strict=True):
        assert np.array_equal(np.asarray(cached), np.asarray(encoded))
        assert cached.info == encoded.info
