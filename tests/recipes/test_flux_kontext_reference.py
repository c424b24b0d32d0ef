"""One flux-kontext-lora step against the loss of diffusers' ``train_dreambooth_lora_flux_kontext.py`` for the same
draws: the reference's lines (latents from the VAE posterior, noise, timesteps, packing, ids, cut, weighted MSE)
written out here as that script writes them, on the tiny Kontext model."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxKontextPipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.flux.tiny import build_tiny_flux_kontext
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.vae import encode_posterior
from dreamstep.recipes.flux_kontext_lora import FluxKontextStep

GUIDANCE = 3.5


def _pixels(seed: int) -> torch.Tensor:
    return torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def _reference_loss(pipe: FluxKontextPipeline, pixel_values: torch.Tensor, cond_pixel_values: torch.Tensor | None,
                    text: dict[str, torch.Tensor], vae_encode_mode: str, weighting_scheme: str) -> torch.Tensor:
    """The reference script's step, from "Convert images to latent space" to the loss (uncached, fp32)."""
    vae, transformer, scheduler = pipe.vae, pipe.transformer, pipe.scheduler
    noise_scheduler_copy = type(scheduler).from_config(scheduler.config)
    has_image_input = cond_pixel_values is not None
    posterior = vae.encode(pixel_values).latent_dist
    model_input = posterior.sample() if vae_encode_mode == "sample" else posterior.mode()
    if has_image_input:
        cond_posterior = vae.encode(cond_pixel_values).latent_dist
        cond_model_input = cond_posterior.sample() if vae_encode_mode == "sample" else cond_posterior.mode()
        cond_model_input = (cond_model_input - vae.config.shift_factor) * vae.config.scaling_factor
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    latent_image_ids = FluxKontextPipeline._prepare_latent_image_ids(
        model_input.shape[0], model_input.shape[2] // 2, model_input.shape[3] // 2, "cpu", torch.float32)
    if has_image_input:
        cond_latents_ids = FluxKontextPipeline._prepare_latent_image_ids(
            cond_model_input.shape[0], cond_model_input.shape[2] // 2, cond_model_input.shape[3] // 2, "cpu",
            torch.float32)
        cond_latents_ids[..., 0] = 1
        latent_image_ids = torch.cat([latent_image_ids, cond_latents_ids], dim=0)
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(weighting_scheme=weighting_scheme, batch_size=bsz, logit_mean=0.0,
                                              logit_std=1.0, mode_scale=1.29)
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    step_indices = [(noise_scheduler_copy.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = noise_scheduler_copy.sigmas[step_indices].flatten().reshape(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed_noisy_model_input = FluxKontextPipeline._pack_latents(noisy_model_input, *model_input.shape)
    orig_inp_shape = packed_noisy_model_input.shape
    if has_image_input:
        packed_cond_input = FluxKontextPipeline._pack_latents(cond_model_input, *cond_model_input.shape)
        packed_noisy_model_input = torch.cat([packed_noisy_model_input, packed_cond_input], dim=1)
    guidance = torch.tensor([GUIDANCE]).expand(bsz)
    model_pred = transformer(hidden_states=packed_noisy_model_input, timestep=timesteps / 1000, guidance=guidance,
                             pooled_projections=text["pooled"], encoder_hidden_states=text["prompt_embeds"],
                             txt_ids=text["text_ids"], img_ids=latent_image_ids, return_dict=False)[0]
    if has_image_input:
        model_pred = model_pred[:, : orig_inp_shape[1]]
    model_pred = FluxKontextPipeline._unpack_latents(model_pred, height=model_input.shape[2] * vae_scale_factor,
                                                     width=model_input.shape[3] * vae_scale_factor,
                                                     vae_scale_factor=vae_scale_factor)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
    return loss.mean()


@pytest.mark.parametrize(("with_condition", "vae_encode_mode", "weighting_scheme"),
                         [(True, "mode", "none"), (True, "sample", "logit_normal"), (False, "mode", "cosmap")])
def test_one_step_has_the_reference_scripts_loss(with_condition: bool, vae_encode_mode: str,
                                                 weighting_scheme: str) -> None:
    pipe = build_tiny_flux_kontext(seed=0)
    add_lora(pipe.transformer, flux_lora_targets(pipe.transformer, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(pipe.transformer)  # LoRA's up weights start at zero: the base's prediction
    pixels, condition = _pixels(1), _pixels(2) if with_condition else None
    text = flux.encode_prompts(pipe, ["make it night", "add a hat"], max_sequence_length=16)
    text["text_ids"] = flux.text_ids(text["prompt_embeds"].shape[1], "cpu", torch.float32)
    batch = {"latent_dist": encode_posterior(pipe.vae, pixels), **text}
    if condition is not None:
        batch["condition_dist"] = encode_posterior(pipe.vae, condition)
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    step = FluxKontextStep(pipe.transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                           accelerator=make_accelerator(mixed_precision="no"), max_grad_norm=1.0,
                           sigmas=flux.training_sigmas(pipe.scheduler),
                           objective=FlowMatchingObjective(weighting_scheme=weighting_scheme), guidance_scale=GUIDANCE,
                           vae_encode_mode=vae_encode_mode)

    torch.manual_seed(7)
    expected = _reference_loss(pipe, pixels, condition, text, vae_encode_mode, weighting_scheme)
    torch.manual_seed(7)
    (loss,) = step(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
