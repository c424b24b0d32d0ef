"""Exact resume with --save_state / --resume (and .ckpt and .safetensors holding the same weights), half
precision, and two processes under `accelerate launch` whose run one process continues."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_then_resume_in_one(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["train", "sdxl-lora", "--pretrained_model_name_or_path", str(tiny_sdxl_dir), "--dataset_config",
            str(write_method(tmp_path, "finetune")), "--output_dir", str(out), *COMMON,
            "--save_every_n_steps", "1", "--save_state", "--network_args", "module_dropout=0.2"]
    # --multi_gpu picks the torchrun launcher; without GPUs the processes talk over gloo on the CPU.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), "-m", "dreamstep", *args, "--max_train_steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "last.safetensors").is_file() and (out / "last-step00000001.safetensors").is_file()
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    # 8 samples in batches of 2 are 4 batches: 2 per process, so step 2 ends the first epoch of two processes.
    assert (state["num_processes"], state["epoch"], state["batch_in_epoch"]) == (2, 0, 2)
    assert result.stdout.count("wrote:") == 1  # one summary, from the main process
    assert any(k.startswith("lora_te1_") for k in load_file(out / "last.safetensors"))  # text encoders trained too
    # One process continues the two-process run from its mid-epoch checkpoint (step 1: one batch into the
    # epoch on each process; one process then reads that epoch as 4 batches and goes on after the first).
    assert run_cli(*args, "--max_train_steps", "4", "--resume", "checkpoint-1") == 0
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert (state["global_step"], state["num_processes"]) == (4, 1)
    assert (out / "last-step00000003.safetensors").is_file()
    with safe_open(out / "last.safetensors", "pt") as f:
        assert f.metadata()["ss_steps"] == "4"
