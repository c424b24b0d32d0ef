"""The FLUX trainers under `accelerate launch --num_processes 2` on CPU (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import FluxControlNetModel, FluxPipeline
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, launch_two, write_control_pairs


def test_two_processes_train_one_lora(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = launch_two(
        "train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--instance_data_dir", ROBOT_DIR,
        "--instance_prompt", ROBOT_PROMPT, "--output_dir", out, "--resolution", "32", "--max_train_steps", "3",
        "--gradient_accumulation_steps", "2", "--checkpointing_steps", "3", "--report_to", "none",
        "--validation_prompt", ROBOT_PROMPT, "--validation_inference_steps", "1", "--num_validation_images", "1")
    assert proc.stdout.count("wrote:") == 1, proc.stdout  # only the main process reports and writes
    rng = torch.load(out / "checkpoint-3" / "random_states.pt", weights_only=True)
    assert len(rng) == 2  # each process's RNG is kept for exact resume
    # 6 images over 2 processes = 3 batches each per epoch, in accumulation groups of 2 + 1: steps 1-2
    # are epoch 0 and step 3 ends after 2 batches of epoch 1 (one process alone would still be in epoch 0).
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert (state["epoch"], state["batch_in_epoch"], state["num_processes"]) == (1, 2, 2)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    pipe.load_lora_weights(out / "pytorch_lora_weights.safetensors")


def test_two_processes_train_one_controlnet(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    images, controls = write_control_pairs(tmp_path)
    out = tmp_path / "out"
    proc = launch_two(
        "train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--train_data_dir", images,
        "--conditioning_data_dir", controls, "--output_dir", out, "--resolution", "32", "--num_double_layers", "1",
        "--num_single_layers", "1", "--max_train_steps", "2", "--checkpointing_steps", "2", "--report_to", "none")
    assert proc.stdout.count("wrote:") == 1, proc.stdout
    assert len(torch.load(out / "checkpoint-2" / "random_states.pt", weights_only=True)) == 2
    FluxControlNetModel.from_pretrained(out)
