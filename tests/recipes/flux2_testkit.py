"""Helpers for the FLUX.2 recipe tests: the tiny [klein] folder, ``train flux2-lora`` in-process, and the
flow-matching loss of a pipeline on images at fixed noise and σ (fair before/after comparisons)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from diffusers import Flux2KleinPipeline
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, load_images

from dreamstep.config.flux2_lora import Flux2LoraConfig
from dreamstep.config.schema import add_arguments, build_config
from dreamstep.diffusion import flow_matching as fm
from dreamstep.models.flux2 import plumbing as flux2
from dreamstep.models.tiny import write_tiny_model
from dreamstep.recipes.flux2_lora import train

__all__ = ["ROBOT_DIR", "ROBOT_PROMPT", "fixed_noise_loss", "generate", "load_images", "smallest_run", "tiny_klein",
           "train_flux2"]


def tiny_klein(folder: Path) -> Path:
    return write_tiny_model("flux2-klein", folder, seed=0)


def smallest_run(trainer: str, root: Path) -> dict[str, str]:
    """The options of a one-step ``train flux2-lora`` run on the tiny [klein] (the option contract's run)."""
    return {"pretrained_model_name_or_path": str(tiny_klein(root / "klein")), "output_dir": str(root / "out"),
            "instance_data_dir": str(ROBOT_DIR), "instance_prompt": ROBOT_PROMPT, "resolution": "32",
            "report_to": "none", "checkpointing_steps": "0", "max_train_steps": "1", "max_sequence_length": "64"}


def train_flux2(*args: object) -> object:
    """``dreamstep train flux2-lora *args``: the flags parsed and checked as the command line does."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, Flux2LoraConfig)
    return train(build_config(Flux2LoraConfig, parser.parse_args([str(a) for a in args])))


@torch.no_grad()
def fixed_noise_loss(pipe: Flux2KleinPipeline, pixels: torch.Tensor, prompt: str,
                     sigmas: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8), seed: int = 0) -> float:
    """Mean flow-matching MSE of ``pipe`` on ``pixels`` over the given σ, with seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    latents = flux2.encode_posterior(pipe.vae, pixels).chunk(2, dim=1)[0]
    n, _, h, w = latents.shape
    embeds = flux2.encode_prompts(pipe, [prompt] * n, max_sequence_length=64)["prompt_embeds"]
    losses = []
    for sigma in sigmas:
        noise = torch.randn(latents.shape, generator=generator)
        s = torch.full((n, 1, 1, 1), sigma)
        tokens = pipe.transformer(hidden_states=flux2.pack(fm.noisy_latents(latents, noise, s)), timestep=s.flatten(),
                                  encoder_hidden_states=embeds, img_ids=flux2.latent_ids(h, w, "cpu"),
                                  txt_ids=flux2.text_ids(embeds.shape[1], "cpu"), return_dict=False)[0]
        pred = flux2.unpack(tokens, h, w)
        losses.append(fm.weighted_mse(pred, fm.velocity_target(latents, noise), s, "none").mean().item())
    return sum(losses) / len(losses)


def generate(pipe: Flux2KleinPipeline, prompt: str = ROBOT_PROMPT, seed: int = 0) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=prompt, num_inference_steps=2, height=32, width=32, guidance_scale=1.0,
                generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
