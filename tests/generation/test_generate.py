"""``dreamstep generate`` on the tiny models: files, names, PNG parameters, defaults, single files,
prompt files and a FLUX ControlNet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from diffusers import FluxControlNetModel, FluxTransformer2DModel
from generation_testkit import FLUX_ARGS, PROMPT, generate, randomize_up, run_cli
from PIL import Image

from dreamstep.png_text import read_parameters


def test_flux_writes_numbered_pngs_with_parameters(tiny_flux_dev_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert run_cli("generate", "flux", "--model", tiny_flux_dev_dir, "--prompt", PROMPT, "--steps", "2",
                   "--width", "48", "--height", "32", "--num_images", "2", "--seed", "5", "--output_dir", out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["00000-5.png", "00001-6.png"]
    assert f"wrote 2 images to {out}" in capsys.readouterr().out
    text, params = read_parameters(out / "00001-6.png")
    assert text.splitlines()[0] == PROMPT
    assert "Steps: 2, Sampler: Euler, CFG scale: 3.5, Seed: 6, Size: 48x32" in text
    assert params["seed"] == 6 and params["steps"] == 2 and params["guidance_scale"] == 3.5
    assert params["model_type"] == "flux" and params["dtype"] == "float32"
    assert Image.open(out / "00000-5.png").size == (48, 32)
    # Image i of a run uses seed + i: the second image comes back alone from its own seed.
    again = tmp_path / "again"
    assert run_cli("generate", "flux", "--model", tiny_flux_dev_dir, "--prompt", PROMPT, "--steps", "2",
                   "--width", "48", "--height", "32", "--seed", "6", "--output_dir", again) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(again / "00000-6.png")),
                                  np.asarray(Image.open(out / "00001-6.png")))


def test_later_runs_keep_earlier_images(tiny_flux_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n\na photo of the dog\n", encoding="utf-8")
    config = tmp_path / "gen.toml"
    config.write_text(f'model = "{tiny_flux_dir}"\nsteps = 1\nwidth = 32\nheight = 32\nseed = 0\n', encoding="utf-8")
    out = tmp_path / "out"
    for _ in range(2):
        assert run_cli("generate", "flux", "--config", config, "--from_file", prompts, "--output_dir", out) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["00000-0.png", "00001-1.png", "00002-0.png", "00003-1.png"]
    _, params = read_parameters(out / "00003-1.png")
    # schnell-like model (no guidance embedding): its own defaults.
    assert params["prompt"] == "a photo of the dog" and params["guidance_scale"] == 0.0


def test_sdxl_defaults_and_negative_prompt(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("generate", "sdxl", "--model", tiny_sdxl_dir, "--prompt", "a cat, red", "--negative_prompt",
                   "blurry", "--steps", "1", "--seed", "1", "--output_dir", out) == 0
    text, params = read_parameters(out / "00000-1.png")
    assert text.splitlines()[:2] == ["a cat, red", "Negative prompt: blurry"]
    assert "Sampler: Euler, CFG scale: 7.0" in text
    assert params["width"] == params["height"] == 64  # the tiny UNet's native size: sample_size 8 x VAE 8
    assert json.loads(Image.open(out / "00000-1.png").text["dreamstep"])["negative_prompt"] == "blurry"


def test_sdxl_single_file_gives_the_folder_image(tiny_sdxl_dir: Path, tiny_sdxl_single_file: Path,
                                                 tmp_path: Path) -> None:
    from_folder = generate("sdxl", tiny_sdxl_dir, tmp_path / "folder")
    from_file = generate("sdxl", tiny_sdxl_single_file, tmp_path / "file", "--model_config", tiny_sdxl_dir)
    np.testing.assert_allclose(from_file, from_folder, atol=2)
    # Offline without --model_config: the configs of the folder the file lies in, as train sdxl-lora reads them.
    beside = generate("sdxl", tiny_sdxl_single_file, tmp_path / "beside")
    np.testing.assert_allclose(beside, from_folder, atol=2)


def test_flux_controlnet(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux_dev_dir, subfolder="transformer")
    controlnet = FluxControlNetModel.from_transformer(
        transformer, num_layers=1, num_single_layers=1, attention_head_dim=transformer.config.attention_head_dim,
        num_attention_heads=transformer.config.num_attention_heads)
    randomize_up(controlnet, ("controlnet_blocks", "controlnet_single_blocks"), seed=0, std=0.5)
    controlnet.save_pretrained(tmp_path / "controlnet")
    control = tmp_path / "edges.png"
    Image.fromarray(np.tile(np.arange(40, dtype=np.uint8)[None, :, None] * 6, (36, 1, 3))).save(control)
    images = {}
    for scale in ("0", "1"):
        out = tmp_path / f"out{scale}"
        assert run_cli("generate", "flux", "--model", tiny_flux_dev_dir, "--prompt", PROMPT, "--steps", "2",
                       "--seed", "0", "--controlnet", tmp_path / "controlnet", "--control_image", control,
                       "--controlnet_conditioning_scale", scale, "--output_dir", out) == 0
        image = Image.open(out / "00000-0.png")
        assert image.size == (32, 32)  # the control image's 40x36, down to multiples of 16
        images[scale] = np.asarray(image, dtype=np.float32)
        text, params = read_parameters(out / "00000-0.png")
        assert params["controlnet_conditioning_scale"] == float(scale) and "ControlNet: controlnet" in text
    assert np.abs(images["1"] - images["0"]).max() > 10


def test_generate_with_loras_prints_no_third_party_notices(tiny_flux_dev_dir: Path, flux_lora: Path,
                                                          flux_lora_2: Path, tmp_path: Path) -> None:
    """Two LoRAs without text-encoder keys used to print diffusers', peft's and torchao's notices."""
    proc = subprocess.run(
        [sys.executable, "-m", "dreamstep", "generate", "flux", "--model", str(tiny_flux_dev_dir), "--prompt", PROMPT,
         "--lora", str(flux_lora), "--lora", f"{flux_lora_2}:0.5", "--output_dir", str(tmp_path), *FLUX_ARGS],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert [line for line in lines if not line.startswith(("generate flux:", "Loading pipeline components"))] == []
