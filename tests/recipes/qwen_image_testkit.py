"""Helpers for the Qwen-Image recipe tests: the tiny model folders, a one-step run's options (the option-contract
test's ``smallest_run``), and the flow-matching loss of a pipeline on images with fixed noise and σ."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import QwenImagePipeline
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT

from dreamstep.diffusion import flow_matching as fm
from dreamstep.models.qwen_image import plumbing as qwen
from dreamstep.models.tiny import write_tiny_model


def tiny_model(variant: str, root: Path) -> Path:
    """The tiny ``variant`` folder under ``root`` (written once per root)."""
    folder = root / f"tiny-{variant}"
    return folder if (folder / "model_index.json").is_file() else write_tiny_model(variant, folder, seed=0)


def smallest_run(trainer: str, root: Path) -> dict[str, str]:
    """The options of a one-step run of ``trainer`` on its tiny model."""
    base = {"output_dir": str(root / "out"), "max_train_steps": "1", "resolution": "32", "report_to": "none",
            "checkpointing_steps": "0", "instance_data_dir": str(ROBOT_DIR), "instance_prompt": ROBOT_PROMPT}
    if trainer == "qwen-image-edit-lora":
        return {**base, "pretrained_model_name_or_path": str(tiny_model("qwen-image-edit", root)),
                "conditioning_data_dir": str(ROBOT_DIR)}
    return {**base, "pretrained_model_name_or_path": str(tiny_model("qwen-image", root))}


@torch.no_grad()
def fixed_noise_loss(pipe: QwenImagePipeline, pixels: torch.Tensor, prompt: str,
                     sigmas: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8), seed: int = 0) -> float:
    """Mean flow-matching MSE of ``pipe`` on ``pixels`` over the given σ, with seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    latents, _ = qwen.encode_posterior(pipe.vae, pixels).chunk(2, dim=1)
    n, _, h, w = latents.shape
    text = qwen.batch_text(qwen.encode_prompts(pipe, [prompt] * n, 512), torch.device("cpu"))
    losses = []
    for sigma in sigmas:
        noise = torch.randn(latents.shape, generator=generator)
        s = torch.full((n, 1, 1, 1), sigma)
        packed = pipe.transformer(hidden_states=qwen.pack(fm.noisy_latents(latents, noise, s)), timestep=s.flatten(),
                                  encoder_hidden_states=text["prompt_embeds"],
                                  encoder_hidden_states_mask=text["prompt_mask"],
                                  img_shapes=qwen.img_shapes(n, [(h, w)]), return_dict=False)[0]
        pred = qwen.unpack(packed, h, w)
        losses.append(fm.weighted_mse(pred, fm.velocity_target(latents, noise), s, "none").mean().item())
    return sum(losses) / len(losses)
