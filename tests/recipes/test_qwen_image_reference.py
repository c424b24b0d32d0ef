"""One qwen-image-lora step against the loss of diffusers' ``train_dreambooth_lora_qwen_image.py`` for the same
draws: the reference's lines (5-D latents from the VAE posterior normalised by the latents mean / std, noise,
timesteps, the permuted packing, ``img_shapes``, the prompt mask, unpacking, weighted MSE, prior preservation)
written out here as that script writes them, on the tiny Qwen-Image model."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import QwenImagePipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.qwen_image import plumbing as qwen
from dreamstep.models.qwen_image.lora_targets import qwen_image_lora_targets
from dreamstep.models.qwen_image.tiny import build_tiny_qwen_image
from dreamstep.recipes.qwen_image_lora import QwenImageLoraStep

PROMPTS = ["a photo of sks dog", "a red cat on the grass in the style of a painting"]
PRIOR_WEIGHT = 0.7


@pytest.fixture(scope="module")
def pipe() -> QwenImagePipeline:
    pipe = build_tiny_qwen_image(seed=0)
    add_lora(pipe.transformer, qwen_image_lora_targets(pipe.transformer, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(pipe.transformer)
    with torch.no_grad():  # LoRA's up weights start at zero: give them values so the adapter takes part
        for name, param in pipe.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return pipe


def _pixels(seed: int) -> torch.Tensor:
    return torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def _reference_loss(pipe: QwenImagePipeline, pixel_values: torch.Tensor, prompt_embeds: torch.Tensor,
                    prompt_embeds_mask: torch.Tensor | None, weighting_scheme: str, prior: bool) -> torch.Tensor:
    """The reference script's step, from "Convert images to latent space" to the loss (uncached, fp32)."""
    vae, transformer = pipe.vae, pipe.transformer
    noise_scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=3.0)
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    vae_scale_factor = 2 ** len(vae.temperal_downsample)
    latents_mean = (torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1))
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    pixel_values = pixel_values.unsqueeze(2)  # collate_fn: "Qwen expects a `num_frames` dimension too"
    model_input = vae.encode(pixel_values).latent_dist.sample()
    model_input = (model_input - latents_mean) * latents_std
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(weighting_scheme=weighting_scheme, batch_size=bsz, logit_mean=0.0,
                                              logit_std=1.0, mode_scale=1.29)
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    step_indices = [(noise_scheduler_copy.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = noise_scheduler_copy.sigmas[step_indices].flatten()
    while len(sigmas.shape) < model_input.ndim:
        sigmas = sigmas.unsqueeze(-1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    latent_height, latent_width = model_input.shape[3], model_input.shape[4]
    img_shapes = [(1, latent_height // 2, latent_width // 2)] * bsz
    noisy_model_input = noisy_model_input.permute(0, 2, 1, 3, 4)
    packed_noisy_model_input = QwenImagePipeline._pack_latents(
        noisy_model_input, batch_size=model_input.shape[0], num_channels_latents=model_input.shape[1],
        height=model_input.shape[3], width=model_input.shape[4])
    model_pred = transformer(hidden_states=packed_noisy_model_input, encoder_hidden_states=prompt_embeds,
                             encoder_hidden_states_mask=prompt_embeds_mask, timestep=timesteps / 1000,
                             img_shapes=img_shapes, return_dict=False)[0]
    model_pred = QwenImagePipeline._unpack_latents(model_pred, latent_height * vae_scale_factor,
                                                   latent_width * vae_scale_factor, vae_scale_factor)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    if prior:
        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
        target, target_prior = torch.chunk(target, 2, dim=0)
        weighting, weighting_prior = torch.chunk(weighting, 2, dim=0)
        prior_loss = torch.mean((weighting_prior.float() * (model_pred_prior.float() - target_prior.float()) ** 2
                                 ).reshape(target_prior.shape[0], -1), 1).mean()
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
    loss = loss.mean()
    return loss + PRIOR_WEIGHT * prior_loss if prior else loss


def _script_prompt_embeddings(pipe: QwenImagePipeline) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The script's per-sample cache (``compute_text_embeddings`` of each caption) joined as its loop joins it."""
    pairs = [pipe.encode_prompt(prompt=[p], max_sequence_length=512) for p in PROMPTS]
    length = max(e.shape[1] for e, _ in pairs)
    embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, length - e.shape[1])) for e, _ in pairs])
    mask = torch.cat([torch.nn.functional.pad(m if m is not None else torch.ones(e.shape[:2], dtype=torch.long),
                                              (0, length - e.shape[1])) for e, m in pairs])
    return embeds, None if mask.all() else mask


@pytest.mark.parametrize(("weighting_scheme", "prior"), [("none", False), ("logit_normal", True), ("cosmap", False)])
def test_one_step_has_the_reference_scripts_loss(pipe: QwenImagePipeline, weighting_scheme: str, prior: bool) -> None:
    pixels = _pixels(1)
    text = qwen.batch_text(qwen.encode_prompts(pipe, PROMPTS, max_sequence_length=512), torch.device("cpu"))
    embeds, mask = _script_prompt_embeddings(pipe)
    assert mask is not None and text["prompt_mask"] is not None  # the two captions differ in length: a real mask
    torch.testing.assert_close(text["prompt_embeds"], embeds)
    torch.testing.assert_close(text["prompt_mask"], mask)
    batch = {"latent_dist": qwen.encode_posterior(pipe.vae, pixels), **text,
             "is_reg": torch.tensor([False, True] if prior else [False, False])}
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    step = QwenImageLoraStep(pipe.transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                             accelerator=make_accelerator(mixed_precision="no"), max_grad_norm=1.0,
                             sigmas=qwen.training_sigmas(pipe.scheduler),
                             objective=FlowMatchingObjective(weighting_scheme=weighting_scheme),
                             prior_loss_weight=PRIOR_WEIGHT if prior else None)

    torch.manual_seed(7)
    expected = _reference_loss(pipe, pixels, embeds, mask, weighting_scheme, prior)
    torch.manual_seed(7)
    (loss,) = step(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
