"""The memory plan: parameter counts of the full-size models on the meta device, the plan command and --dry_run,
and bad sizes (the estimate against measured steps: test_plan_phases.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dreamstep.cli import main
from dreamstep.config.memory import parse_bytes
from dreamstep.models import memory_plan as mp
from dreamstep.models.plans import flux_components, sdxl_components

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT  # noqa: E402


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_full_size_parameter_counts_on_the_meta_device() -> None:
    flux = flux_components(None)
    sdxl = sdxl_components(None)
    transformer = flux["transformer"]
    assert round(_count(transformer) / 1e9, 2) == 11.90
    assert round(_count(transformer.transformer_blocks[0]) / 1e6) == 340
    assert round(_count(transformer.single_transformer_blocks[0]) / 1e6) == 142
    assert (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)) == (19, 38)
    assert round(_count(flux["text_encoder_2"]) / 1e9, 2) == 4.76
    assert round(_count(flux["text_encoder"]) / 1e6) == 123
    assert round(_count(flux["vae"]) / 1e6) == 84
    assert round(_count(sdxl["unet"]) / 1e9, 2) == 2.57
    assert round(_count(sdxl["text_encoder_2"]) / 1e6) == 695
    assert all(p.device.type == "meta" for m in (*flux.values(), *sdxl.values()) for p in m.parameters())


def test_plan_command_says_what_fits(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "flux", "--device_memory", "12GB", "--base_quantization", "int8"]) == 0
    out = capsys.readouterr().out
    assert "11.90B" in out and "int8" in out and "does NOT fit" in out
    # Every phase, with T5 priced while it encodes and waiting in host memory while the transformer trains.
    assert all(f"  {phase}: on the device" in out for phase in ("encode", "load", "train", "validate"))
    assert "peak device memory" in out and "peak host memory" in out
    assert main(["plan", "sdxl", "--device_memory", "8GB"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "would fit:" in out and "--blocks_to_swap" in out


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "flux-lora", "--pretrained_model_name_or_path", str(tiny_flux_dev_dir),
                 "--output_dir", str(tmp_path / "out"), "--instance_data_dir", str(ROBOT_DIR),
                 "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--dry_run", "--device_memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "memory plan" in out and "transformer (frozen)" in out and ": fits" in out
    assert not (tmp_path / "out").exists()


def test_a_bad_memory_size_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["plan", "sdxl", "--device_memory", "12XB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--device_memory '12XB'" in err and "12GB" in err
    assert parse_bytes("24 GiB", "x") == 24 * 2**30 and parse_bytes("8000MB", "x") == 8000 * 2**20
