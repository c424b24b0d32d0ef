"""Exact resume with --save_state / --resume (and .ckpt and .safetensors holding the same weights), half
precision, and two processes under `accelerate launch`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from sdxl_testkit import run_cli, write_method

COMMON = ("--network_dim", "4", "--network_alpha", "4", "--network_dropout", "0.1", "--learning_rate", "1e-3",
          "--seed", "5", "--log_with", "none")


def test_resume_is_exact_and_ckpt_equals_safetensors(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    toml = write_method(tmp_path, "captions")  # 8 samples, batch 2: 4 steps an epoch
    base = ("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config", toml, *COMMON)
    assert run_cli(*base, "--output_dir", tmp_path / "straight", "--max_train_steps", "6") == 0
    interrupted = tmp_path / "interrupted"
    assert run_cli(*base, "--output_dir", interrupted, "--max_train_steps", "3", "--save_state") == 0
    assert (interrupted / "checkpoint-3").is_dir() and not (interrupted / "last-step00000003.safetensors").exists()
    assert run_cli(*base, "--output_dir", interrupted, "--max_train_steps", "6", "--resume", "latest",
                   "--save_model_as", "ckpt") == 0
    straight = load_file(tmp_path / "straight" / "last.safetensors")
    resumed = torch.load(interrupted / "last.ckpt", weights_only=True)
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key


def test_bf16_with_bf16_network_weights(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
                   write_method(tmp_path, "class_tokens"), "--output_dir", out, *COMMON, "--max_train_steps", "2",
                   "--mixed_precision", "bf16", "--full_bf16", "--no_half_vae", "--network_train_text_encoder_only",
                   "--save_precision", "fp16", "--logging_dir", tmp_path / "tb", "--log_with", "tensorboard") == 0
    weights = load_file(out / "last.safetensors")
    assert weights and all(k.startswith("lora_te") for k in weights)
    assert all(v.dtype == torch.float16 for v in weights.values())
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")) and not list(out.glob("events.out.tfevents.*"))


def test_two_processes_under_accelerate_launch(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--cpu", "-m", "dreamstep", "train", "sdxl-lora",
               "--pretrained_model_name_or_path", str(tiny_sdxl_dir), "--dataset_config",
               str(write_method(tmp_path, "finetune")), "--output_dir", str(out), *COMMON, "--max_train_steps", "2",
               "--save_every_n_steps", "1", "--save_state", "--network_args", "module_dropout=0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "last.safetensors").is_file() and (out / "last-step00000001.safetensors").is_file()
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir()
    assert result.stdout.count("wrote:") == 1  # one summary, from the main process
    assert any(k.startswith("lora_te1_") for k in load_file(out / "last.safetensors"))  # text encoders trained too
