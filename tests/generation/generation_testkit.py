"""Helpers for the generation tests: run ``dreamstep generate`` in-process and read back what it wrote, and
make LoRA files the way the trainers do (their own injection and saving code), with random weights so that
they change the image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import FluxPipeline, StableDiffusionXLPipeline
from PIL import Image

from dreamstep.cli import main
from dreamstep.config.lycoris import LycorisOptions
from dreamstep.lora.formats import model_keys, pipeline_configs
from dreamstep.lora.inject import add_lora, save_flux_lora
from dreamstep.lora.kohya_network import NetworkOptions, create_network
from dreamstep.lora.lycoris_network import create_network as create_lycoris_network
from dreamstep.lora.lycoris_network import file_names, sdxl_targets
from dreamstep.models.flux.lora_targets import flux_lora_targets

PROMPT = "a photo of sks dog"
FLUX_ARGS = ("--steps", "2", "--width", "32", "--height", "32", "--seed", "7")
SDXL_ARGS = ("--steps", "2", "--width", "32", "--height", "32", "--seed", "7")


def run_cli(*args: object) -> int:
    return main([str(a) for a in args])


def generate(model_type: str, model: Path, out: Path, *extra: object) -> np.ndarray:
    """Generate one image with the tiny-model settings into the empty folder ``out``; return it as float."""
    args = FLUX_ARGS if model_type == "flux" else SDXL_ARGS
    assert run_cli("generate", model_type, "--model", model, "--prompt", PROMPT, "--output_dir", out,
                   *args, *extra) == 0
    (path,) = sorted(out.glob("*.png"))
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)


def randomize_up(module: torch.nn.Module, names: tuple[str, ...], seed: int, std: float) -> None:
    """Replace the zero-initialised up/B matrices so the LoRA does something."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if any(n in name for n in names):
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def flux_lora_file(model_dir: Path, out_dir: Path, seed: int) -> Path:
    """A FLUX LoRA as ``train flux-lora`` writes it: peft adapters on the attention layers (rank 4,
    alpha 2) saved by its :func:`save_flux_lora` in the diffusers layout."""
    pipe = FluxPipeline.from_pretrained(model_dir)
    transformer = pipe.transformer
    add_lora(transformer, flux_lora_targets(transformer, ["attention"]), rank=4, alpha=2.0)
    randomize_up(transformer, ("lora_B",), seed, std=2.0)
    return save_flux_lora(out_dir, transformer, weight_name=f"flux_lora_{seed}.safetensors")


def sdxl_kohya_lora_file(model_dir: Path, path: Path, seed: int) -> Path:
    """An SDXL LoRA as ``train sdxl-lora`` writes it: sd-scripts' network (UNet and both text encoders,
    dim 4, alpha 2) saved with Kohya key names."""
    pipe = StableDiffusionXLPipeline.from_pretrained(model_dir)
    encoders = {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
    network = create_network(pipe.unet, encoders, NetworkOptions(dim=4, alpha=2.0))
    randomize_up(network, ("lora_up",), seed, std=1.0)
    return network.save_weights(path, None, {"ss_network_dim": "4", "ss_network_alpha": "2.0"})


def lycoris_file(model_type: str, model_dir: Path, path: Path, options: LycorisOptions, seed: int,
                 std: float = 0.2) -> Path:
    """A LyCORIS file as the trainers write it (their module choice and names: flux-lora's attention preset;
    sdxl-lora's sd-scripts network with LyCORIS' default preset), every adapter tensor moved off its initial
    value so that it changes the image."""
    if model_type == "flux":
        pipe = FluxPipeline.from_pretrained(model_dir)
        components = {"transformer": pipe.transformer}
        targets = {f"transformer.{p}": pipe.transformer.get_submodule(p)
                   for p in flux_lora_targets(pipe.transformer, ["attention"])}
    else:
        pipe = StableDiffusionXLPipeline.from_pretrained(model_dir)
        components = {"unet": pipe.unet, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
        targets = sdxl_targets(pipe.unet, {k: v for k, v in components.items() if k != "unet"}, "full", conv=True)
    keys = model_keys(model_type, pipeline_configs(pipe))
    torch.manual_seed(seed)
    network = create_lycoris_network(file_names(keys, components), targets, options)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in network.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * std)
    return network.save_weights(path, None, {})
