"""Bad input to ``dreamstep generate`` gets one ``error:`` line naming the flag, before any model loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from generation_testkit import PROMPT, run_cli

from dreamstep.generation.loras import LoraSpec, parse_lora_spec


def _error_line(capsys: pytest.CaptureFixture, *args: object) -> str:
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    return line


@pytest.mark.parametrize("lora, expected", [
    ("missing.safetensors", "--lora missing.safetensors: file not found"),
    ("{file}:strong", "weight 'strong' is not a number; write FILE:WEIGHT"),
    ("{file}:nan", "weight must be a finite number"),
    ("missing.safetensors:0.5", "file missing.safetensors not found"),
])
def test_bad_lora_values(tiny_flux_dir: Path, tmp_path: Path, capsys, lora: str, expected: str) -> None:
    file = tmp_path / "style.safetensors"
    file.write_bytes(b"")
    line = _error_line(capsys, "generate", "flux", "--model", tiny_flux_dir, "--prompt", PROMPT,
                       "--output_dir", tmp_path / "out", "--lora", lora.format(file=file))
    assert expected in line
    assert not (tmp_path / "out").exists()


def test_lora_for_the_other_model(tiny_flux_dev_dir: Path, sdxl_kohya_lora: Path, tmp_path: Path, capsys) -> None:
    line = _error_line(capsys, "generate", "flux", "--model", tiny_flux_dev_dir, "--prompt", PROMPT, "--steps", "1",
                       "--output_dir", tmp_path, "--lora", sdxl_kohya_lora)
    assert str(sdxl_kohya_lora) in line and "SDXL" in line


@pytest.mark.parametrize("args, expected", [
    ((), "give --prompt or --from_file"),
    (("--prompt", "a", "--width", "40"), "--width 40: FLUX needs a multiple of 16 (e.g. 32)"),
    (("--prompt", "a", "--negative_prompt", "b"), "--negative_prompt has no effect on FLUX unless --true_cfg_scale"),
    (("--prompt", "a", "--controlnet", "cn"), "--controlnet needs --control_image"),
    (("--prompt", "a", "--num_images", "0"), "--num_images must be at least 1"),
    (("--prompt", "a", "--dtype", "fp8"), "'fp8' is not a valid choice"),
    (("--from_file", "nope.txt"), "--from_file nope.txt: file not found"),
    (("--prompt", "a", "--model_config", "x"), "--model_config only applies to a single-file --model"),
])
def test_bad_flags(tiny_flux_dir: Path, tmp_path: Path, capsys, args: tuple[str, ...], expected: str) -> None:
    assert expected in _error_line(capsys, "generate", "flux", "--model", tiny_flux_dir, "--output_dir", tmp_path,
                                   *args)


def test_bad_model_writes_nothing(tmp_path: Path, capsys) -> None:
    line = _error_line(capsys, "generate", "sdxl", "--model", tmp_path / "nowhere", "--prompt", "a",
                       "--output_dir", tmp_path / "out")
    assert "nowhere' does not exist" in line
    assert not (tmp_path / "out").exists()


def test_a_lone_single_file_offline_names_the_model_config_flag(tiny_sdxl_single_file: Path, tmp_path: Path) -> None:
    """Run as a user runs it: one line at the door, before diffusers tries the hub."""
    lone = tmp_path / "sd_xl_base_1.0.safetensors"
    shutil.copy(tiny_sdxl_single_file, lone)
    proc = subprocess.run([sys.executable, "-m", "dreamstep", "generate", "sdxl", "--model", str(lone), "--prompt", "a",
                           "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    err = proc.stderr
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --model: {lone} is a lone single file")
    assert "give --model_config a diffusers SDXL folder" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--true_cfg_scale", "--controlnet", "--control_image",
                                  "--controlnet_conditioning_scale"])
def test_sdxl_refuses_and_hides_flux_only_flags(tmp_path: Path, capsys, flag: str) -> None:
    line = _error_line(capsys, "generate", "sdxl", "--model", tmp_path, "--prompt", "a", flag, "2")
    assert f"unknown flag {flag}" in line
    with pytest.raises(SystemExit):
        run_cli("generate", "sdxl", "--help")
    assert flag not in capsys.readouterr().out


def test_lora_spec_keeps_colons_of_existing_files(tmp_path: Path) -> None:
    odd = tmp_path / "style:v2.safetensors"
    odd.write_bytes(b"")
    assert parse_lora_spec(str(odd)) == LoraSpec(odd, 1.0)
    assert parse_lora_spec(f"{odd}:0.25") == LoraSpec(odd, 0.25)


@pytest.mark.parametrize("args, expected", [
    (("--prompt", "a"), "--image"),  # what FLUX.1 Kontext edits is required
    (("--prompt", "a", "--image", "nope.png"), "--image nope.png: file not found"),
    (("--prompt", "a", "--image", "{image}", "--negative_prompt", "b"), "unless --true_cfg_scale"),
])
def test_bad_kontext_flags(tiny_flux_kontext_dir: Path, tmp_path: Path, capsys, args: tuple[str, ...],
                           expected: str) -> None:
    from PIL import Image

    image = tmp_path / "in.png"
    Image.new("RGB", (32, 32)).save(image)
    line = _error_line(capsys, "generate", "flux-kontext", "--model", tiny_flux_kontext_dir, "--output_dir",
                       tmp_path / "out", *(str(a).format(image=image) for a in args))
    assert expected in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type, extra, expected", [
    ("flux-kontext", (), "eval flux-kontext scores edits: give --image"),
    ("flux", ("--image", "{image}"), "flux generates from the prompt: use eval flux-kontext"),
])
def test_eval_asks_for_the_image_kontext_edits(tiny_flux_kontext_dir: Path, tmp_path: Path, capsys,
                                               model_type: str, extra: tuple[str, ...], expected: str) -> None:
    from PIL import Image

    image = tmp_path / "in.png"
    Image.new("RGB", (32, 32)).save(image)
    line = _error_line(capsys, "eval", model_type, "--model", tiny_flux_kontext_dir, "--weights", tmp_path,
                       "--prompt", "a", "--metrics", "clip_t", "--output_dir", tmp_path / "out",
                       *(str(a).format(image=image) for a in extra))
    assert expected in line
    assert not (tmp_path / "out").exists()
