"""One Krea 2 flow-matching step against the loss of diffusers' ``train_dreambooth_lora_krea2.py`` for the same
draws: the reference's lines (a draw from the Qwen-Image VAE's posterior, the per-channel normalisation, noise,
timesteps from the scheduler's table, the inlined 2x2 packing, position ids, the mask, the unpacking, the weighted
MSE and the prior loss) written out here as that script writes them, on the tiny Krea 2 model."""

from __future__ import annotations

import pytest
import torch
from diffusers import Krea2Pipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.krea2 import plumbing
from dreamstep.models.krea2.lora_targets import krea2_lora_targets
from dreamstep.models.krea2.step import Krea2FlowMatchingStep
from dreamstep.models.krea2.tiny import build_tiny_krea2
from dreamstep.models.precision import cast_trainable_params_to_fp32

PROMPTS = ["a photo of sks dog", "a red cat in the style of a painting with blue"]


@torch.no_grad()
def _reference_loss(pipe: Krea2Pipeline, pixel_values: torch.Tensor, prompt_embeds: torch.Tensor,
                    prompt_embeds_mask: torch.Tensor, weighting_scheme: str, prior_loss_weight: float | None
                    ) -> torch.Tensor:
    """The reference script's step, from "Convert images to latent space" to the loss (uncached, fp32)."""
    vae, transformer = pipe.vae, pipe.transformer
    noise_scheduler_copy = type(pipe.scheduler).from_config(pipe.scheduler.config)
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    model_input = vae.encode(pixel_values.unsqueeze(2)).latent_dist.sample()
    model_input = (model_input - latents_mean) * latents_std
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(weighting_scheme=weighting_scheme, batch_size=bsz, logit_mean=0.0,
                                              logit_std=1.0, mode_scale=1.29)
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    step_indices = [(noise_scheduler_copy.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = noise_scheduler_copy.sigmas[step_indices].flatten().reshape(-1, 1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    noisy_model_input = noisy_model_input.permute(0, 2, 1, 3, 4)
    c, h, w = model_input.shape[1], model_input.shape[3], model_input.shape[4]
    packed = noisy_model_input.reshape(bsz, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    packed = packed.reshape(bsz, (h // 2) * (w // 2), c * 4)
    position_ids = Krea2Pipeline.prepare_position_ids(prompt_embeds.shape[1], h // 2, w // 2, "cpu")
    model_pred = transformer(hidden_states=packed, encoder_hidden_states=prompt_embeds, timestep=timesteps / 1000,
                             position_ids=position_ids, encoder_attention_mask=prompt_embeds_mask,
                             return_dict=False)[0]
    ch = model_pred.shape[2]
    model_pred = model_pred.view(bsz, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    model_pred = model_pred.reshape(bsz, ch // 4, 1, h, w)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    if prior_loss_weight is not None:
        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
        target, target_prior = torch.chunk(target, 2, dim=0)
        weighting, weighting_prior = torch.chunk(weighting, 2, dim=0)
        prior_loss = torch.mean((weighting_prior.float() * (model_pred_prior.float() - target_prior.float()) ** 2
                                 ).reshape(target_prior.shape[0], -1), 1).mean()
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
                      1).mean()
    return loss + prior_loss_weight * prior_loss if prior_loss_weight is not None else loss


@pytest.mark.parametrize(("weighting_scheme", "prior_loss_weight"),
                         [("none", None), ("logit_normal", None), ("cosmap", 0.5)])
def test_one_step_has_the_reference_scripts_loss(weighting_scheme: str, prior_loss_weight: float | None) -> None:
    pipe = build_tiny_krea2(seed=0)
    add_lora(pipe.transformer, krea2_lora_targets(pipe.transformer, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(pipe.transformer)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    reference_embeds, reference_mask = pipe.encode_prompt(prompt=list(PROMPTS), device="cpu", max_sequence_length=32)
    text = plumbing.encode_prompts(pipe, PROMPTS, max_sequence_length=32)
    torch.testing.assert_close(text["prompt_embeds"], reference_embeds)
    assert reference_embeds.shape[2] == pipe.transformer.config.num_text_layers  # several layers' features
    assert not bool(reference_mask.all())  # the captions are padded, and the padding masked
    batch = {"latent_dist": plumbing.encode_posterior(pipe.vae, pixels), **text,
             "is_reg": torch.tensor([False, True])}
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    step = Krea2FlowMatchingStep(pipe.transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                                 accelerator=make_accelerator(mixed_precision="no"), max_grad_norm=1.0,
                                 sigmas=plumbing.training_sigmas(pipe.scheduler),
                                 objective=FlowMatchingObjective(weighting_scheme=weighting_scheme),
                                 prior_loss_weight=prior_loss_weight)

    torch.manual_seed(7)
    expected = _reference_loss(pipe, pixels, reference_embeds, reference_mask, weighting_scheme, prior_loss_weight)
    torch.manual_seed(7)
    (loss,) = step(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    print(f"krea2 reference loss ({weighting_scheme}, prior {prior_loss_weight}): {float(expected):.6f}, "
          f"ours {float(loss):.6f}")
