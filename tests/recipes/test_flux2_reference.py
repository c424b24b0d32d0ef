"""One FLUX.2 LoRA step against the loss of diffusers' ``train_dreambooth_lora_flux2_klein.py`` and
``train_dreambooth_lora_flux2.py`` (text to image, [klein] and [dev]) and their ``_img2img`` versions (a condition
image beside the target) for the same draws: the scripts' lines (posterior mode, 2x2 patchify, batch-norm
normalisation, ids, noise, timesteps, packing, guidance for [dev], the cut, weighted MSE) written out here as they
write them, on the tiny [klein] and [dev] models."""

from __future__ import annotations

import pytest
import torch
from diffusers import Flux2KleinPipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.flux2 import plumbing as flux2
from dreamstep.models.flux2.lora_targets import flux2_lora_targets
from dreamstep.models.flux2.step import Flux2Step
from dreamstep.models.flux2.tiny import build_tiny_flux2_dev, build_tiny_flux2_klein
from dreamstep.models.precision import cast_trainable_params_to_fp32

GUIDANCE = 3.5  # the dev script's --guidance_scale default
BUILD = {"klein": build_tiny_flux2_klein, "dev": build_tiny_flux2_dev}


def _pixels(seed: int) -> torch.Tensor:
    return torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def _reference_loss(pipe: Flux2KleinPipeline, pixel_values: torch.Tensor, cond_pixel_values: torch.Tensor | None,
                    prompt_embeds: torch.Tensor, text_ids: torch.Tensor, weighting_scheme: str) -> torch.Tensor:
    """The scripts' step from "Convert images to latent space" to the loss (uncached latents, fp32)."""
    vae, transformer = pipe.vae, pipe.transformer
    noise_scheduler_copy = type(pipe.scheduler).from_config(pipe.scheduler.config)
    latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    model_input = vae.encode(pixel_values).latent_dist.mode()
    model_input = Flux2KleinPipeline._patchify_latents(model_input)
    model_input = (model_input - latents_bn_mean) / latents_bn_std
    model_input_ids = Flux2KleinPipeline._prepare_latent_ids(model_input)
    if cond_pixel_values is not None:
        cond_model_input = vae.encode(cond_pixel_values).latent_dist.mode()
        cond_model_input = Flux2KleinPipeline._patchify_latents(cond_model_input)
        cond_model_input = (cond_model_input - latents_bn_mean) / latents_bn_std
        cond_model_input_ids = Flux2KleinPipeline._prepare_image_ids([cond_model_input[0:1]])
        cond_model_input_ids = cond_model_input_ids.expand(cond_model_input.shape[0], -1, -1)
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(weighting_scheme=weighting_scheme, batch_size=bsz, logit_mean=0.0,
                                              logit_std=1.0, mode_scale=1.29)
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    step_indices = [(noise_scheduler_copy.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = noise_scheduler_copy.sigmas[step_indices].flatten().reshape(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed_noisy_model_input = Flux2KleinPipeline._pack_latents(noisy_model_input)
    orig_input_shape, orig_input_ids_shape = packed_noisy_model_input.shape, model_input_ids.shape
    if cond_pixel_values is not None:
        packed_cond_model_input = Flux2KleinPipeline._pack_latents(cond_model_input)
        packed_noisy_model_input = torch.cat([packed_noisy_model_input, packed_cond_model_input], dim=1)
        model_input_ids = torch.cat([model_input_ids, cond_model_input_ids], dim=1)
    guidance = None
    if transformer.config.guidance_embeds:  # the klein script's test; the dev script always feeds it
        guidance = torch.full([1], GUIDANCE).expand(model_input.shape[0])
    model_pred = transformer(hidden_states=packed_noisy_model_input, timestep=timesteps / 1000, guidance=guidance,
                             encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=model_input_ids,
                             return_dict=False)[0]
    model_pred = model_pred[:, : orig_input_shape[1], :]
    model_input_ids = model_input_ids[:, : orig_input_ids_shape[1], :]
    model_pred = Flux2KleinPipeline._unpack_latents_with_ids(model_pred, model_input_ids)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
    return loss.mean()


@pytest.mark.parametrize(("variant", "with_condition", "weighting_scheme"),
                         [("klein", False, "none"), ("klein", False, "logit_normal"), ("klein", True, "cosmap"),
                          ("klein", True, "none"), ("dev", False, "none"), ("dev", True, "logit_normal")])
def test_one_step_has_the_reference_scripts_loss(variant: str, with_condition: bool, weighting_scheme: str) -> None:
    pipe = BUILD[variant](seed=0)
    add_lora(pipe.transformer, flux2_lora_targets(pipe.transformer, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(pipe.transformer)
    pixels, condition = _pixels(1), _pixels(2) if with_condition else None
    prompts = ["a photo of sks dog", "a red robot in the style of a painting"]
    prompt_embeds, text_ids = pipe.encode_prompt(prompt=prompts, max_sequence_length=32)  # the script's encoding
    batch = {"latent_dist": flux2.encode_posterior(pipe.vae, pixels),
             **flux2.encode_prompts(pipe, prompts, max_sequence_length=32)}
    if condition is not None:
        batch["condition_dist"] = flux2.encode_posterior(pipe.vae, condition)
    torch.testing.assert_close(batch["prompt_embeds"], prompt_embeds)
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    step = Flux2Step(pipe.transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                     accelerator=make_accelerator(mixed_precision="no"), max_grad_norm=1.0,
                     sigmas=flux2.training_sigmas(pipe.scheduler),
                     objective=FlowMatchingObjective(weighting_scheme=weighting_scheme),
                     guidance_scale=GUIDANCE if pipe.transformer.config.guidance_embeds else None)

    torch.manual_seed(7)
    expected = _reference_loss(pipe, pixels, condition, prompt_embeds, text_ids, weighting_scheme)
    torch.manual_seed(7)
    (loss,) = step(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    print(f"{variant} condition={with_condition} {weighting_scheme}: dreamstep {loss.item():.6f}, "
          f"script {expected.item():.6f}")


def test_the_cached_latents_are_the_scripts_normalised_patches() -> None:
    """The cache's posterior mean is the script's model_input; its std is the posterior std in the same units."""
    pipe = build_tiny_flux2_klein(seed=0)
    pixels = _pixels(3)
    with torch.no_grad():
        posterior = pipe.vae.encode(pixels).latent_dist
    mean_bn = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std_bn = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    expected = (Flux2KleinPipeline._patchify_latents(posterior.mode()) - mean_bn) / std_bn
    mean, std = flux2.encode_posterior(pipe.vae, pixels).chunk(2, dim=1)
    torch.testing.assert_close(mean, expected)
    torch.testing.assert_close(std, Flux2KleinPipeline._patchify_latents(posterior.std) / std_bn)
    assert mean.shape == (2, 4 * pipe.vae.config.latent_channels, 2, 3)
