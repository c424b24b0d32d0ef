"""Trainers, generate and eval on FLUX.1 component files (flux1 / clip_l / t5xxl / ae .safetensors, sd-scripts' flag
names): the same run as from the diffusers folder, an fp8-stored transformer trained as the fp8 base, and the
flags that cannot apply refused in one line."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli, write_control_pairs
from PIL import Image
from safetensors.torch import load_file, save_file

COMMON = ("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
          "--report_to", "none", "--checkpointing_steps", "0", "--max_train_steps", "2", "--learning_rate", "1e-3")


def _file_flags(files: dict[str, Path], prefix: str = "") -> tuple[object, ...]:
    return ("--pretrained_model_name_or_path", files[f"{prefix}transformer"], "--clip_l", files[f"{prefix}clip_l"],
            "--t5xxl", files[f"{prefix}t5xxl"], "--ae", files[f"{prefix}ae"])


def test_flux_lora_from_the_files_is_the_run_from_the_folder(tiny_flux_dev_dir: Path,
                                                              tiny_flux_files: dict[str, Path],
                                                              tmp_path: Path) -> None:
    # sd-scripts' spelling: the transformer file as the model, the other parts by flag; the tokenizers (which no
    # file holds) from --model_config. The fp32 files hold the folder's weights exactly: the LoRA is the same.
    assert run_cli("train", "flux-lora", *_file_flags(tiny_flux_files, "fp32_"), "--model_config", tiny_flux_dev_dir,
                   *COMMON, "--output_dir", tmp_path / "files") == 0
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, *COMMON,
                   "--output_dir", tmp_path / "folder") == 0
    from_files = load_file(tmp_path / "files" / "pytorch_lora_weights.safetensors")
    from_folder = load_file(tmp_path / "folder" / "pytorch_lora_weights.safetensors")
    assert from_files.keys() == from_folder.keys()
    for key, value in from_folder.items():
        torch.testing.assert_close(from_files[key], value, atol=1e-6, rtol=0)


def test_an_fp8_transformer_file_trains_as_the_fp8_base(tiny_flux_dev_dir: Path, tiny_flux_files: dict[str, Path],
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fp8"
    assert run_cli("train", "flux-lora", *_file_flags(tiny_flux_files), "--pretrained_model_name_or_path",
                   tiny_flux_files["fp8_transformer"], "--t5xxl", tiny_flux_files["fp8_t5xxl"],
                   "--model_config", tiny_flux_dev_dir, "--mixed_precision", "bf16", *COMMON, "--output_dir", out) == 0
    # The file's fp8 storage is the base's quantization (sd-scripts' --fp8_base), said in the saved settings.
    assert '\nbase_quantization = "fp8"\n' in (out / "config.toml").read_text()
    lora = load_file(out / "pytorch_lora_weights.safetensors")
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in lora
    assert all(torch.isfinite(v).all() for v in lora.values())


def test_generate_from_the_files_is_the_folder_image(tiny_flux_dev_dir: Path, tiny_flux_files: dict[str, Path],
                                                     tmp_path: Path) -> None:
    args = ("--prompt", ROBOT_PROMPT, "--steps", "2", "--width", "32", "--height", "32", "--seed", "3")
    assert run_cli("generate", "flux", "--model", tiny_flux_dev_dir, *args, "--output_dir", tmp_path / "a") == 0
    files = tiny_flux_files
    assert run_cli("generate", "flux", "--model", files["fp32_transformer"], "--clip_l", files["fp32_clip_l"],
                   "--t5xxl", files["fp32_t5xxl"], "--ae", files["fp32_ae"], "--model_config", tiny_flux_dev_dir,
                   *args, "--output_dir", tmp_path / "b") == 0
    # The same weights (the fp32 files): the same image but for float rounding (1/255 at a pixel or two).
    from_files, from_folder = (np.asarray(Image.open(tmp_path / run / "00000-3.png"), dtype=int) for run in "ba")
    assert np.abs(from_files - from_folder).max() <= 1 and (from_files != from_folder).mean() < 0.01


@pytest.mark.parametrize("command", ["train", "generate", "eval"])
def test_wrong_files_are_named_before_anything_loads(command: str, tiny_flux_dev_dir: Path,
                                                     tiny_flux_files: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    wrong = ("--pretrained_model_name_or_path" if command == "train" else "--model", tiny_flux_files["transformer"],
             "--ae", tiny_flux_files["clip_l"], "--model_config", tiny_flux_dev_dir)
    out = tmp_path / "out"
    lora = tmp_path / "lora.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 4)}, str(lora))
    args = {"train": ("train", "flux-lora", *wrong, *COMMON, "--output_dir", out),
            "generate": ("generate", "flux", *wrong, "--prompt", "a", "--output_dir", out),
            "eval": ("eval", "flux", *wrong, "--weights", lora, "--prompt", "a", "--metrics", "clip_t",
                     "--output_dir", out)}[command]
    assert run_cli(*args) == 2
    assert capsys.readouterr().err == (f"error: --ae {tiny_flux_files['clip_l']} is a CLIP text encoder of width 32, "
                                       "not the FLUX.1 autoencoder (ae.safetensors); give that file\n")
    assert not out.exists()


@pytest.mark.parametrize("recipe", ["flux-controlnet", "flux-kontext-lora"])
def test_every_flux_trainer_plans_from_the_files(recipe: str, tiny_flux_kontext_dir: Path,
                                                 tiny_flux_files: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    images, controls = write_control_pairs(tmp_path / "pairs")
    data = {"flux-controlnet": ("--train_data_dir", images, "--conditioning_data_dir", controls,
                                "--num_double_layers", "1", "--num_single_layers", "1"),
            "flux-kontext-lora": ("--instance_data_dir", images, "--conditioning_data_dir", controls)}[recipe]
    assert run_cli("train", recipe, *_file_flags(tiny_flux_files, "fp8_"), "--model_config", tiny_flux_kontext_dir,
                   *data, "--resolution", "32", "--output_dir", tmp_path / "out", "--dry_run") == 0
    # The plan is of the fp8 base the transformer file is.
    assert re.search(r"transformer \(frozen\) +\S+ +fp8 ", capsys.readouterr().out)
