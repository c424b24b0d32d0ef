"""`--blocks_to_swap` on sdxl-lora: the UNet's transformer blocks swapped (up-path ones, the last in
execution order) give the same network as keeping them resident, also on an fp8 UNet, and a swapped run
resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sdxl_testkit import run_cli, write_method

from dreamstep.models.blocks import repeated_blocks


def test_swapped_unet_blocks_train_the_same_network_and_resume(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    blocks = len(repeated_blocks(UNet2DConditionModel.from_pretrained(tiny_sdxl_dir / "unet")))
    base = ("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
            write_method(tmp_path, "captions"), "--network_dim", "4", "--network_alpha", "4", "--learning_rate", "1e-2",
            "--seed", "5", "--log_with", "none", "--gradient_checkpointing")
    assert run_cli(*base, "--output_dir", tmp_path / "resident", "--max_train_steps", "4") == 0
    swapped = tmp_path / "swapped"
    swap = ("--blocks_to_swap", str(blocks - 1))
    assert run_cli(*base, *swap, "--output_dir", swapped, "--max_train_steps", "2", "--save_state") == 0
    assert run_cli(*base, *swap, "--output_dir", swapped, "--max_train_steps", "4", "--resume", "latest") == 0
    expected = load_file(tmp_path / "resident" / "last.safetensors")
    got = load_file(swapped / "last.safetensors")
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-7)
    assert any(key.startswith("lora_unet_output_blocks") and value.abs().max() > 0 and "lora_up" in key
               for key, value in expected.items())


def test_an_fp8_unet_with_swapped_blocks_trains_the_same_network(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    """sd-scripts' small-card recipe on SDXL: --fp8_base (torchao fp8 weights) with blocks swapped."""
    pytest.importorskip("torchao", reason="--fp8_base needs the 'quant' extra")
    base = ("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
            write_method(tmp_path, "captions"), "--network_dim", "4", "--network_alpha", "4", "--learning_rate", "1e-2",
            "--seed", "5", "--log_with", "none", "--gradient_checkpointing", "--fp8_base", "--max_train_steps", "2")
    assert run_cli(*base, "--output_dir", tmp_path / "resident") == 0
    assert run_cli(*base, "--blocks_to_swap", "2", "--output_dir", tmp_path / "swapped") == 0
    expected = load_file(tmp_path / "resident" / "last.safetensors")
    got = load_file(tmp_path / "swapped" / "last.safetensors")
    assert got.keys() == expected.keys()
    assert any("lora_up" in key and value.abs().max() > 0 for key, value in expected.items())
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6)
