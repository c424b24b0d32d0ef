"""Helpers for the Z-Image recipe tests: the tiny base and a "Turbo" beside it (the same architecture, other
weights, in a folder named as the download is), the trainer run through the CLI, and a fixed-noise loss."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ZImagePipeline

from dreamstep import cli
from dreamstep.diffusion import flow_matching as fm
from dreamstep.models.vae import encode_posterior
from dreamstep.models.z_image import plumbing
from dreamstep.models.z_image.step import caption_features, z_image_velocity

ROBOT_DIR = Path(__file__).resolve().parents[2] / "examples" / "robot"
ROBOT_PROMPT = "a photo of sks robot"


def run_train(*args: object) -> int:
    """``dreamstep train z-image-lora *args`` in-process."""
    return cli.main(["train", "z-image-lora", *(str(a) for a in args)])


def smallest_run(trainer: str, root: Path) -> dict[str, str]:
    """The options of a one-step run of ``train z-image-lora`` on the tiny Z-Image (built under ``root``), for the
    option-contract test."""
    from dreamstep.models.tiny import write_tiny_model

    model = write_tiny_model("z-image", root / "tiny-z-image", seed=0)
    return {"pretrained_model_name_or_path": str(model), "output_dir": str(root / "out"), "max_train_steps": "1",
            "resolution": "32", "report_to": "none", "checkpointing_steps": "0",
            "instance_data_dir": str(ROBOT_DIR), "instance_prompt": ROBOT_PROMPT}


@torch.no_grad()
def fixed_noise_loss(pipe: ZImagePipeline, pixels: torch.Tensor, prompt: str, fractions=(0.25, 0.5, 0.75)) -> float:
    """The unweighted flow-matching loss of ``pipe``'s transformer on ``pixels`` at fixed σ and fixed noise."""
    latents = encode_posterior(pipe.vae, pixels).chunk(2, dim=1)[0]
    text = plumbing.encode_prompts(pipe, [prompt] * len(pixels), max_sequence_length=64)
    captions = caption_features(text)
    sigmas_table = plumbing.training_sigmas(pipe.scheduler)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    losses = []
    for fraction in fractions:
        sigma = torch.full((len(latents), 1, 1, 1), fm.sigma_at_fraction(sigmas_table, fraction))
        noisy = fm.noisy_latents(latents, noise, sigma)
        pred = z_image_velocity(pipe.transformer, noisy, sigma, captions)
        losses.append(float((pred - fm.velocity_target(latents, noise)).pow(2).mean()))
    return sum(losses) / len(losses)


def load_images(folder: Path, resolution: int) -> torch.Tensor:
    from PIL import Image

    images = []
    for path in sorted(folder.glob("*.png")):
        image = Image.open(path).convert("RGB").resize((resolution, resolution))
        images.append(torch.from_numpy(__import__("numpy").asarray(image)).permute(2, 0, 1).float() / 127.5 - 1)
    return torch.stack(images)
