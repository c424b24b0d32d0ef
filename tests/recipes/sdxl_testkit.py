"""Helpers for the SDXL recipe tests: small image sets written as each of the seed's three dataset methods,
the CLI run in-process, and the noise-prediction loss of the tiny SDXL with a trained network on fixed
noise and timesteps (so before/after comparisons are fair)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dreamstep.cli import main
from dreamstep.diffusion import noise_prediction as noise_math
from dreamstep.generation.loras import LoraSpec, apply_loras
from dreamstep.lora.kohya_network import NetworkOptions, create_network
from dreamstep.models.sdxl import plumbing as sdxl
from dreamstep.models.sdxl.tiny import build_tiny_sdxl

CAPTIONS = ("a red dog", "a blue cat", "a red cat", "a blue dog")


def run_cli(*args: object) -> int:
    return main([str(a) for a in args])


def write_images(folder: Path, size: tuple[int, int] = (64, 64), count: int = 4, seed: int = 0) -> list[Path]:
    """``count`` images with a coloured half and a noisy half, named img0.png ..."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        array = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
        array[:, : size[0] // 2] = (200, 30, 30) if i % 2 == 0 else (30, 30, 200)
        paths.append(folder / f"img{i}.png")
        Image.fromarray(array).save(paths[-1])
    return paths


def write_method(root: Path, method: str) -> Path:
    """Images plus a dataset TOML written as the seed's method: 'class_tokens', 'captions' or 'finetune'."""
    images = root / "butterfly"
    paths = write_images(images)
    subset = f"random_crop = true\nimage_dir = '{images.as_posix()}'\nnum_repeats = 2\n"
    if method == "class_tokens":
        subset += "class_tokens = 'sks dog'\n"
    elif method == "captions":
        subset += "caption_extension = '.txt'\n"
        for path, caption in zip(paths, CAPTIONS):
            path.with_suffix(".txt").write_text(caption + "\n")
    else:
        metadata = {p.stem: {"caption": c} for p, c in zip(paths, CAPTIONS)}
        (root / "metadata.json").write_text(json.dumps(metadata))
        subset += f"metadata_file = '{(root / 'metadata.json').as_posix()}'\n"
    toml = root / f"{method}.toml"
    toml.write_text("[general]\nenable_bucket = false\n\n[[datasets]]\nresolution = 64\nbatch_size = 2\n\n"
                    f"  [[datasets.subsets]]\n{subset}")
    return toml


def captions_for(method: str) -> list[str]:
    return ["sks dog"] * 4 if method == "class_tokens" else list(CAPTIONS)


def load_pixels(folder: Path) -> torch.Tensor:
    """(N, 3, 64, 64) in [-1, 1]."""
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in sorted(folder.glob("*.png"))]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


@torch.no_grad()
def fixed_noise_loss(pixels: torch.Tensor, captions: list[str], lora_file: Path | None = None,
                     timesteps: tuple[int, ...] = (100, 300, 500, 700, 900), seed: int = 0,
                     as_generate: bool = False) -> float:
    """Mean ε-prediction MSE of the tiny SDXL (seed 0), with the UNet LoRA in ``lora_file`` applied (with
    ``as_generate``: any file, as ``dreamstep generate`` applies it), on
    ``pixels`` over ``timesteps`` with seeded noise."""
    pipe = build_tiny_sdxl(seed=0)
    if lora_file is not None and as_generate:
        apply_loras(pipe, [LoraSpec(lora_file)], "sdxl", merge=False)  # any layout, UNet and text encoders
    elif lora_file is not None:
        encoders = {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
        network = create_network(pipe.unet, encoders, NetworkOptions(dim=8, alpha=8.0), train_text_encoder=False)
        network.load_weights(lora_file)
        network.eval()
    generator = torch.Generator().manual_seed(seed)
    latents, _ = sdxl.encode_posterior(pipe.vae, pixels).chunk(2, dim=1)
    embeds = sdxl.encode_prompts(pipe, captions)
    n = latents.shape[0]
    time_ids = sdxl.add_time_ids(torch.tensor([[64, 64]] * n), torch.zeros(n, 2, dtype=torch.long),
                                 torch.tensor([[64, 64]] * n))
    scheduler = noise_math.training_scheduler(pipe.scheduler.config)
    losses = []
    for t in timesteps:
        noise = torch.randn(latents.shape, generator=generator)
        steps = torch.full((n,), t)
        pred = pipe.unet(scheduler.add_noise(latents, noise, steps), steps,
                         encoder_hidden_states=embeds["prompt_embeds"],
                         added_cond_kwargs={"text_embeds": embeds["pooled"], "time_ids": time_ids},
                         return_dict=False)[0]
        losses.append(noise_math.per_sample_mse(pred, noise).mean().item())
    return sum(losses) / len(losses)
