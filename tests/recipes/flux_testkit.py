"""Helpers for the FLUX recipe tests: run the CLI in-process, and measure the flow-matching loss of a
pipeline on a set of images with fixed noise and fixed σ (so before/after comparisons are fair)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import torch
from diffusers import FluxPipeline
from launch_testkit import accelerate_launch
from PIL import Image, ImageDraw

from dreamstep.cli import main
from dreamstep.diffusion import flow_matching as fm
from dreamstep.models.flux import plumbing as flux

ROBOT_DIR = Path(__file__).resolve().parents[2] / "examples" / "robot"
ROBOT_PROMPT = "a photo of sks robot"


def run_cli(*args: str) -> int:
    return main([str(a) for a in args])


def launch_two(*args: object) -> subprocess.CompletedProcess:
    """``dreamstep *args`` under ``accelerate launch`` with 2 CPU processes (gloo); asserts success."""
    return accelerate_launch("-m", "dreamstep", *args)


def write_control_pairs(root: Path, count: int = 4, size: int = 32) -> tuple[Path, Path]:
    """``count`` targets (an orange ball, captioned) and control images (its outline) in ``root``."""
    images, controls = root / "images", root / "conditioning"
    images.mkdir(parents=True)
    controls.mkdir()
    for i in range(count):
        target, control = Image.new("RGB", (size, size), "navy"), Image.new("RGB", (size, size), "black")
        ImageDraw.Draw(target).ellipse((4 * i, 4 * i, 4 * i + 12, 4 * i + 12), fill="orange")
        ImageDraw.Draw(control).rectangle((4 * i, 4 * i, 4 * i + 12, 4 * i + 12), outline="white")
        target.save(images / f"{i}.png")
        control.save(controls / f"{i}.png")
        (images / f"{i}.txt").write_text("an orange ball")
    return images, controls


def load_images(folder: Path, resolution: int) -> torch.Tensor:
    """(N, 3, R, R) in [-1, 1]."""
    arrays = [np.asarray(Image.open(p).convert("RGB").resize((resolution, resolution)))
              for p in sorted(folder.glob("*.png"))]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


@torch.no_grad()
def fixed_noise_loss(pipe: FluxPipeline, pixels: torch.Tensor, prompt: str,
                     sigmas: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8), seed: int = 0) -> float:
    """Mean flow-matching MSE of ``pipe`` on ``pixels`` over the given σ, with seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    latents, _ = flux.encode_posterior(pipe.vae, pixels).chunk(2, dim=1)
    n, _, h, w = latents.shape
    embeds = flux.encode_prompts(pipe, [prompt] * n, max_sequence_length=512)
    guidance = torch.full((n,), 3.5) if pipe.transformer.config.guidance_embeds else None
    losses = []
    for sigma in sigmas:
        noise = torch.randn(latents.shape, generator=generator)
        s = torch.full((n, 1, 1, 1), sigma)
        packed = pipe.transformer(
            hidden_states=flux.pack(fm.noisy_latents(latents, noise, s)), timestep=s.flatten(), guidance=guidance,
            pooled_projections=embeds["pooled"], encoder_hidden_states=embeds["prompt_embeds"],
            txt_ids=flux.text_ids(embeds["prompt_embeds"].shape[1], "cpu", torch.float32),
            img_ids=flux.latent_image_ids(h, w, "cpu", torch.float32), return_dict=False)[0]
        pred = flux.unpack(packed, h, w)
        losses.append(fm.weighted_mse(pred, fm.velocity_target(latents, noise), s, "none").mean().item())
    return sum(losses) / len(losses)


def generate(pipe: FluxPipeline, prompt: str = ROBOT_PROMPT, seed: int = 0) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt=prompt, num_inference_steps=2, height=32, width=32, guidance_scale=3.5,
                 generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
    return image
