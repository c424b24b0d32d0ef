"""Each trainer runs with the training options of issue 24 on the command line, and its config.toml says so."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli
from sdxl_testkit import write_method


def _resolved(out: Path) -> dict:
    return tomllib.loads((out / "config.toml").read_text())


def test_flux_lora_trains_with_sd_scripts_sampling_huber_loss_and_caption_dropout(tiny_flux_dir: Path,
                                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
                   "--max_train_steps", "2", "--report_to", "none", "--checkpointing_steps", "0",
                   "--timestep_sampling", "shift", "--discrete_flow_shift", "2.5", "--loss_type", "huber",
                   "--huber_schedule", "exponential", "--caption_dropout_rate", "0.5") == 0
    resolved = _resolved(out)
    assert (resolved["timestep_sampling"], resolved["discrete_flow_shift"], resolved["loss_type"],
            resolved["huber_schedule"], resolved["caption_dropout_rate"]) == ("shift", 2.5, "huber", "exponential", 0.5)
    assert (out / "pytorch_lora_weights.safetensors").is_file()


def test_sdxl_lora_trains_with_smooth_l1_debiased_loss_input_perturbation_and_shuffled_captions(
        tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
                   write_method(tmp_path, "class_tokens"), "--output_dir", out, "--max_train_steps", "2",
                   "--log_with", "none", "--loss_type", "smooth_l1", "--debiased_estimation_loss",
                   "--ip_noise_gamma", "0.1", "--shuffle_caption", "--caption_dropout_rate", "0.5") == 0
    resolved = _resolved(out)
    assert (resolved["loss_type"], resolved["debiased_estimation_loss"], resolved["ip_noise_gamma"],
            resolved["shuffle_caption"]) == ("smooth_l1", True, 0.1, True)
    assert (out / "last.safetensors").is_file()

