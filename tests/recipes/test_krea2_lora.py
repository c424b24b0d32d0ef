"""``dreamstep train krea2-lora`` on the tiny Krea 2: learning on RAW, samples drawn with --validation_model_path
Turbo, the files diffusers' Krea2Pipeline loads (the diffusers and the ComfyUI layout), and a Turbo base named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Krea2Pipeline
from krea2_testkit import ROBOT_DIR, ROBOT_PROMPT
from safetensors.torch import load_file

from dreamstep.cli import main
from dreamstep.diffusion import flow_matching as fm
from dreamstep.models.krea2 import plumbing
from dreamstep.models.krea2.step import krea2_velocity
from dreamstep.models.krea2.tiny import build_tiny_krea2
from dreamstep.models.tiny import write_tiny_model
from dreamstep.png_text import read_parameters

BASE_ARGS = ("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
             "--report_to", "none", "--checkpointing_steps", "0", "--max_sequence_length", "16")


def run_train(*args: object) -> int:
    return main(["train", "krea2-lora", *(str(a) for a in args)])


@pytest.fixture(scope="module")
def tiny_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("krea2", tmp_path_factory.mktemp("tiny") / "krea2-raw", seed=0)


@pytest.fixture(scope="module")
def tiny_turbo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "krea2-turbo"
    build_tiny_krea2(seed=1, distilled=True).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained(tiny_raw: Path, tiny_turbo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("krea2_lora") / "out"
    assert run_train("--pretrained_model_name_or_path", tiny_raw, "--output_dir", out, *BASE_ARGS,
                     "--lora_layers", "all-linear", "--rank", "8", "--lora_alpha", "4", "--learning_rate", "5e-3",
                     "--max_train_steps", "120", "--validation_prompt", ROBOT_PROMPT, "--num_validation_images", "1",
                     "--validation_inference_steps", "2", "--validation_steps", "60",
                     "--validation_model_path", tiny_turbo) == 0
    return out


@torch.no_grad()
def _fixed_noise_loss(pipe: Krea2Pipeline, prompt: str) -> float:
    from PIL import Image

    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB").resize((32, 32)))).permute(2, 0, 1)
                          .float() / 127.5 - 1 for p in sorted(ROBOT_DIR.glob("*.png"))])
    latents = plumbing.encode_posterior(pipe.vae, pixels).chunk(2, dim=1)[0]
    text = plumbing.encode_prompts(pipe, [prompt] * len(pixels), max_sequence_length=16)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    losses = []
    for fraction in (0.25, 0.5, 0.75):
        sigma = torch.full((len(latents), 1, 1, 1), fm.sigma_at_fraction(plumbing.training_sigmas(pipe.scheduler),
                                                                          fraction))
        pred = krea2_velocity(pipe.transformer, fm.noisy_latents(latents, noise, sigma), sigma,
                              text["prompt_embeds"], text["prompt_mask"])
        losses.append(float((pred - fm.velocity_target(latents, noise)).pow(2).mean()))
    return sum(losses) / len(losses)


def test_loss_on_the_instance_images_falls(trained: Path, tiny_raw: Path) -> None:
    pipe = Krea2Pipeline.from_pretrained(tiny_raw)
    before = _fixed_noise_loss(pipe, ROBOT_PROMPT)
    pipe.load_lora_weights(trained / "pytorch_lora_weights.safetensors")
    after = _fixed_noise_loss(pipe, ROBOT_PROMPT)
    print(f"krea2 fixed-noise loss on the instance images: {before:.4f} before, {after:.4f} after")
    assert after < 0.9 * before, (before, after)


def test_both_layouts_load_in_diffusers_and_change_turbos_output(trained: Path, tiny_turbo: Path) -> None:
    comfyui = load_file(trained / "pytorch_lora_weights_comfyui.safetensors")
    assert "diffusion_model.blocks.0.attn.wq.lora_A.weight" in comfyui
    assert "diffusion_model.blocks.1.mlp.down.lora_B.weight" in comfyui
    pipe = Krea2Pipeline.from_pretrained(tiny_turbo)

    def image() -> np.ndarray:
        return np.asarray(pipe(ROBOT_PROMPT, height=32, width=32, num_inference_steps=2, guidance_scale=0.0,
                               max_sequence_length=16, generator=torch.Generator().manual_seed(0)).images[0], float)

    base = image()
    outputs = []
    for name in ("pytorch_lora_weights", "pytorch_lora_weights_comfyui"):
        pipe.load_lora_weights(trained / f"{name}.safetensors", adapter_name=name)
        pipe.set_adapters([name])
        outputs.append(image())
    assert np.abs(outputs[0] - base).mean() > 1.0  # the LoRA trained on RAW changes Turbo's picture
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1.0)


def test_validation_samples_are_drawn_by_turbo(trained: Path, tiny_turbo: Path) -> None:
    text, parameters = read_parameters(trained / "samples/validation-000060.png")
    assert "Model: krea2-turbo" in text and "CFG scale: 0" in text
    assert all(cell["model"] == str(tiny_turbo) for cell in parameters["images"])


def test_turbo_as_the_base_is_named_once_with_raw(tiny_turbo: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    assert run_train("--pretrained_model_name_or_path", tiny_turbo, "--output_dir", tmp_path / "out", *BASE_ARGS,
                     "--dry_run") == 0
    said = "".join(capsys.readouterr())
    assert said.count("is Krea 2 Turbo, a distilled model") == 1 and "krea/Krea-2-Raw" in said


def test_a_z_image_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    z_image = write_tiny_model("z-image", tmp_path / "z")
    assert run_train("--pretrained_model_name_or_path", z_image, "--output_dir", tmp_path / "out", *BASE_ARGS) == 2
    assert "holds a ZImagePipeline (a Z-Image model: train it with 'dreamstep train z-image-lora'), not Krea 2" in \
        capsys.readouterr().err


def test_generate_turbo_with_the_comfyui_file(trained: Path, tiny_turbo: Path, tmp_path: Path) -> None:
    args = ["generate", "krea2", "--model", str(tiny_turbo), "--prompt", ROBOT_PROMPT, "--width", "32", "--height",
            "32", "--seed", "2"]
    assert main([*args, "--output_dir", str(tmp_path / "base")]) == 0
    assert main([*args, "--output_dir", str(tmp_path / "lora"), "--lora",
                 str(trained / "pytorch_lora_weights_comfyui.safetensors")]) == 0
    text, params = read_parameters(tmp_path / "lora" / "00000-2.png")
    assert "Steps: 8" in text and "CFG scale: 0" in text  # Turbo's own defaults
    from PIL import Image

    base, lora = (np.asarray(Image.open(tmp_path / d / "00000-2.png"), float) for d in ("base", "lora"))
    assert np.abs(base - lora).mean() > 1.0
