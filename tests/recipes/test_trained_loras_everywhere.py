"""LoRAs trained by the FLUX and SDXL trainers, converted either way with `dreamstep convert lora`, give
`dreamstep generate` the same image as the file the trainer wrote."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli
from PIL import Image
from sdxl_testkit import write_method

# uint8 images; the same LoRA reached by another route may round a few values the other way.
SAME = 3
CHANGED = 8


def _generate(model_type: str, model: Path, out: Path, *extra: object) -> np.ndarray:
    assert run_cli("generate", model_type, "--model", model, "--prompt", ROBOT_PROMPT, "--output_dir", out,
                   "--steps", "2", "--width", "32", "--height", "32", "--seed", "3", *extra) == 0
    (path,) = out.glob("*.png")
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)


def test_flux_trainer_lora_converted_both_ways(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "train"
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--output_dir", out,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
                   "--lora_layers", "all-linear", "--rank", "4", "--lora_alpha", "8", "--learning_rate", "2e-2",
                   "--max_train_steps", "12", "--report_to", "none", "--checkpointing_steps", "0") == 0
    trained = out / "pytorch_lora_weights.safetensors"
    kohya, back = tmp_path / "kohya.safetensors", tmp_path / "back.safetensors"
    assert run_cli("convert", "lora", trained, kohya, "--to", "kohya", "--model", "flux") == 0
    assert run_cli("convert", "lora", kohya, back, "--to", "diffusers", "--model", "flux") == 0
    base = _generate("flux", tiny_flux_dev_dir, tmp_path / "base")
    original = _generate("flux", tiny_flux_dev_dir, tmp_path / "original", "--lora", trained)
    assert np.abs(original - base).max() > CHANGED
    for name, file in (("kohya", kohya), ("back", back)):
        np.testing.assert_allclose(_generate("flux", tiny_flux_dev_dir, tmp_path / name, "--lora", file), original,
                                   atol=SAME, err_msg=name)


def test_sdxl_trainer_lora_converted_both_ways(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "train"
    assert run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
                   write_method(tmp_path, "class_tokens"), "--output_dir", out, "--network_dim", "4",
                   "--network_alpha", "8", "--learning_rate", "5e-2", "--max_train_steps", "6",
                   "--log_with", "none") == 0
    trained = out / "last.safetensors"
    diffusers_file, back = tmp_path / "diffusers.safetensors", tmp_path / "back.safetensors"
    assert run_cli("convert", "lora", trained, diffusers_file, "--to", "diffusers", "--model", "sdxl") == 0
    assert run_cli("convert", "lora", diffusers_file, back, "--to", "kohya", "--model", "sdxl") == 0
    base = _generate("sdxl", tiny_sdxl_dir, tmp_path / "base")
    original = _generate("sdxl", tiny_sdxl_dir, tmp_path / "original", "--lora", trained)
    assert np.abs(original - base).max() > CHANGED
    for name, file in (("diffusers", diffusers_file), ("back", back)):
        np.testing.assert_allclose(_generate("sdxl", tiny_sdxl_dir, tmp_path / name, "--lora", file), original,
                                   atol=SAME, err_msg=name)
