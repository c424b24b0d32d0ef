import torch

from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.tiny import build_tiny_flux


def test_training_sigmas_survive_a_pipeline_call():
    scheduler = build_tiny_flux(guidance_embeds=True).scheduler
    before = flux.training_sigmas(scheduler)
    scheduler.set_timesteps(28, mu=1.0)  # what a validation or class-image pipeline call does
    after = flux.training_sigmas(scheduler)
    assert before.shape == (1000,) and torch.equal(before, after)


def test_pack_and_unpack_are_inverse():
    latents = torch.randn(2, 16, 6, 4)
    tokens = flux.pack(latents)
    assert tokens.shape == (2, 3 * 2, 64)
    assert torch.equal(flux.unpack(tokens, 6, 4), latents)


def test_assemble_pipeline_builds_another_flux_pipeline_over_the_same_modules():
    from types import SimpleNamespace

    from diffusers import FluxImg2ImgPipeline, FluxKontextPipeline, FluxPipeline

    components = SimpleNamespace(**build_tiny_flux().components)
    assert type(flux.assemble_pipeline(components)) is FluxPipeline
    for pipeline_class in (FluxKontextPipeline, FluxImg2ImgPipeline):
        pipeline = flux.assemble_pipeline(components, pipeline_class=pipeline_class)
        assert type(pipeline) is pipeline_class
        assert pipeline.transformer is components.transformer and pipeline.vae is components.vae
