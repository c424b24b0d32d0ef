"""Krea 2 plumbing: the Qwen-Image VAE's posterior in the transformer's latent units, caption features through
diffusers' own ``Krea2Pipeline.encode_prompt`` (its system prompt, the selected layers' hidden states, a fixed
length with a mask), and the training σ table."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import Krea2Pipeline, Krea2Transformer2DModel
from PIL import Image

from dreamstep.data.cache import text_content_key
from dreamstep.models.krea2 import configs
from dreamstep.models.z_image.plumbing import Kind, ZImageConditioner
from dreamstep.png_text import JSON_KEY, sample_parameters


def latent_normalization(vae: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and 1/std (1, C, 1, 1) of the VAE's latents: the transformer reads (z - mean) / std."""
    channels = vae.config.z_dim
    return (torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1),
            1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1))


def encode_posterior(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1], (B, 3, H, W) -> the posterior's mean and std in the transformer's units, (B, 2C, H/8,
    W/8), float32 (the VAE's single frame axis dropped)."""
    posterior = vae.encode(pixels.unsqueeze(2).to(vae.device, vae.dtype)).latent_dist
    mean, inverse_std = (t.to(pixels.device) for t in latent_normalization(vae))
    return torch.cat([(posterior.mean.float().squeeze(2) - mean) * inverse_std,
                      posterior.std.float().squeeze(2) * inverse_std], dim=1)


@torch.no_grad()
def encode_prompts(pipeline: Krea2Pipeline, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The caption features ``Krea2Pipeline.encode_prompt`` makes: ``prompt_embeds`` (B, S, L, D) fp32 on the CPU
    and ``prompt_mask`` (B, S), for a fixed S."""
    embeds, mask = pipeline.encode_prompt(prompt=list(prompts), device=pipeline.text_encoder.device,
                                          max_sequence_length=max_sequence_length)
    return {"prompt_embeds": embeds.float().cpu(), "prompt_mask": mask.cpu()}


def training_sigmas(scheduler: Any) -> torch.Tensor:
    """The σ table of training, (num_train_timesteps,): a fresh scheduler's, unshifted with Krea 2's dynamic
    shifting, as the script reads it."""
    fresh = type(scheduler).from_config(scheduler.config)
    return fresh.sigmas[:fresh.config.num_train_timesteps].clone()


class Krea2Conditioner(ZImageConditioner):
    """Z-Image's conditioner with Krea 2's posterior (Qwen-Image's VAE) and caption features (the selected layers'
    hidden states, fixed length, with their mask)."""

    def posterior(self, pixels: torch.Tensor) -> torch.Tensor:
        return encode_posterior(self.components.vae, pixels)

    def prompts(self, captions: list[str], known: Any = None) -> dict[str, torch.Tensor]:
        def encode(missing: list[int]) -> dict[str, torch.Tensor]:
            return encode_prompts(self.encoding_pipeline, [captions[i] for i in missing], self.max_sequence_length)

        found = self.text_cache.get_or_compute([text_content_key(c) for c in captions], encode, known)
        return {name: found[name].to(self.device, non_blocking=True) for name in ("prompt_embeds", "prompt_mask")}


@torch.no_grad()
def generate(pipeline: Krea2Pipeline, prompts: list[str], *, seed: int, steps: int, guidance_scale: float,
             height: int, width: int, embeddings: dict[str, dict[str, torch.Tensor]],
             negative: dict[str, torch.Tensor] | None = None) -> list[Image.Image]:
    """One image per prompt from its cached caption features (and the empty prompt's for guidance > 0), each from
    its own generator seeded ``seed + i``, carrying its parameters in ``image.info``; the text encoder is not
    used."""
    view = Krea2Pipeline(**{**pipeline.components, "text_encoder": None},
                         text_encoder_select_layers=pipeline.text_encoder_select_layers,
                         is_distilled=pipeline.config.is_distilled, patch_size=pipeline.patch_size)
    view.set_progress_bar_config(disable=True)
    dtype = pipeline.transformer.dtype
    images = []
    for i, prompt in enumerate(prompts):
        text = {"prompt_embeds": embeddings[prompt]["prompt_embeds"].to(dtype),
                "prompt_embeds_mask": embeddings[prompt]["prompt_mask"]}
        if guidance_scale > 0:
            text |= {"negative_prompt_embeds": negative["prompt_embeds"].to(dtype),
                     "negative_prompt_embeds_mask": negative["prompt_mask"]}
        image = view(**text, num_inference_steps=steps, guidance_scale=guidance_scale, height=height, width=width,
                     generator=torch.Generator("cpu").manual_seed(seed + i)).images[0]
        image.info[JSON_KEY] = sample_parameters(view, prompt=prompt, seed=seed + i, steps=steps,
                                                 guidance_scale=guidance_scale, width=width, height=height)
        images.append(image)
    return images


KREA2 = Kind("Krea 2", Krea2Pipeline, Krea2Transformer2DModel, ("Krea2Pipeline",), configs.RAW_ID)
