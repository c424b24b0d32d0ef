"""One z-image-lora step against the loss of diffusers' ``train_dreambooth_lora_z_image.py`` for the same draws:
the reference's lines (the VAE posterior's mode, noise, timesteps from the scheduler's table, the reversed
timestep, the lists of 5-D latents and caption features, the negated prediction, the weighted MSE and the prior
loss) written out here as that script writes them, on the tiny Z-Image model."""

from __future__ import annotations

import pytest
import torch
from diffusers import ZImagePipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.vae import encode_posterior
from dreamstep.models.z_image import plumbing
from dreamstep.models.z_image.lora_targets import z_image_lora_targets
from dreamstep.models.z_image.step import ZImageFlowMatchingStep
from dreamstep.models.z_image.tiny import build_tiny_z_image

PROMPTS = ["a photo of sks dog", "a red cat in the style of a painting with blue"]


@torch.no_grad()
def _reference_loss(pipe: ZImagePipeline, pixel_values: torch.Tensor, prompt_embeds: list[torch.Tensor],
                    weighting_scheme: str, prior_loss_weight: float | None) -> torch.Tensor:
    """The reference script's step, from "Convert images to latent space" to the loss (uncached, fp32)."""
    vae, transformer = pipe.vae, pipe.transformer
    noise_scheduler_copy = type(pipe.scheduler).from_config(pipe.scheduler.config)
    model_input = vae.encode(pixel_values).latent_dist.mode()
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(weighting_scheme=weighting_scheme, batch_size=bsz, logit_mean=0.0,
                                              logit_std=1.0, mode_scale=1.29)
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    step_indices = [(noise_scheduler_copy.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = noise_scheduler_copy.sigmas[step_indices].flatten().reshape(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    timestep_normalized = (1000 - timesteps) / 1000
    noisy_model_input_list = list(noisy_model_input.unsqueeze(2).unbind(dim=0))
    model_pred_list = transformer(noisy_model_input_list, timestep_normalized, prompt_embeds, return_dict=False)[0]
    model_pred = -torch.stack(model_pred_list, dim=0).squeeze(2)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    if prior_loss_weight is not None:
        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
        target, target_prior = torch.chunk(target, 2, dim=0)
        prior_loss = torch.mean((weighting.float()[1:] * (model_pred_prior.float() - target_prior.float()) ** 2
                                 ).reshape(target_prior.shape[0], -1), 1).mean()
        weighting = weighting[:1]
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
                      1).mean()
    return loss + prior_loss_weight * prior_loss if prior_loss_weight is not None else loss


@pytest.mark.parametrize(("weighting_scheme", "prior_loss_weight"),
                         [("none", None), ("logit_normal", None), ("cosmap", 0.5)])
def test_one_step_has_the_reference_scripts_loss(weighting_scheme: str, prior_loss_weight: float | None) -> None:
    pipe = build_tiny_z_image(seed=0)
    add_lora(pipe.transformer, z_image_lora_targets(pipe.transformer, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(pipe.transformer)  # LoRA's up weights start at zero: the base's prediction
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    # The script's caption features: encode_prompt's list (it templates the list it is given in place).
    reference_embeds, _ = pipe.encode_prompt(prompt=list(PROMPTS), device="cpu", max_sequence_length=64)
    text = plumbing.encode_prompts(pipe, PROMPTS, max_sequence_length=64)
    assert text["prompt_lengths"].tolist() == [len(e) for e in reference_embeds]
    assert len(set(text["prompt_lengths"].tolist())) == 2  # the lists really are ragged
    batch = {"latent_dist": encode_posterior(pipe.vae, pixels), **text, "is_reg": torch.tensor([False, True])}
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    step = ZImageFlowMatchingStep(pipe.transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                                  accelerator=make_accelerator(mixed_precision="no"), max_grad_norm=1.0,
                                  sigmas=plumbing.training_sigmas(pipe.scheduler),
                                  objective=FlowMatchingObjective(weighting_scheme=weighting_scheme),
                                  prior_loss_weight=prior_loss_weight)

    torch.manual_seed(7)
    expected = _reference_loss(pipe, pixels, reference_embeds, weighting_scheme, prior_loss_weight)
    torch.manual_seed(7)
    (loss,) = step(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    print(f"z-image reference loss ({weighting_scheme}, prior {prior_loss_weight}): {float(expected):.6f}, "
          f"ours {float(loss):.6f}")
