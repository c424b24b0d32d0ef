"""`dreamstep generate flux2-klein` / `generate flux2` and `eval flux2-klein` on the tiny FLUX.2 models: a LoRA that
`train flux2-lora` wrote (run through the command line) changes the image, reference images edit, the [dev] pipeline
generates, the base is checked before anything loads, and eval scores the run against the base model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dreamstep.cli import main
from dreamstep.models.tiny import write_tiny_model
from dreamstep.png_text import read_parameters

ROBOT_DIR = Path(__file__).resolve().parents[2] / "examples" / "robot"
PROMPT = "a photo of sks robot"


def run_cli(*args: object) -> int:
    return main([str(a) for a in args])


def error_line(capsys: pytest.CaptureFixture[str], *args: object) -> str:
    """The one error line of a command that fails on its input (exit status 2)."""
    assert run_cli(*args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def klein(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("flux2-klein", tmp_path_factory.mktemp("flux2") / "klein")


@pytest.fixture(scope="module")
def run(klein: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flux2_run") / "out"
    assert run_cli("train", "flux2-lora", "--pretrained_model_name_or_path", klein, "--output_dir", out,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", PROMPT, "--resolution", "32",
                   "--report_to", "none", "--max_train_steps", "8", "--checkpointing_steps", "4",
                   "--learning_rate", "1e-2", "--max_sequence_length", "64") == 0
    return out


def _generate(klein: Path, out: Path, *flags: object) -> np.ndarray:
    assert run_cli("generate", "flux2-klein", "--model", klein, "--prompt", PROMPT, "--steps", "2", "--seed", "3",
                   "--width", "32", "--height", "32", "--output_dir", out, *flags) == 0
    (png,) = sorted(out.glob("*.png"))
    return np.asarray(Image.open(png), dtype=np.float32)


def test_a_trained_lora_changes_the_image(klein: Path, run: Path, tmp_path: Path) -> None:
    plain = _generate(klein, tmp_path / "plain")
    with_lora = _generate(klein, tmp_path / "lora", "--lora", run / "pytorch_lora_weights.safetensors",
                          "--negative_prompt", "blurry", "--guidance_scale", "2")
    assert np.abs(with_lora - plain).max() > 2
    _, params = read_parameters(next((tmp_path / "lora").glob("*.png")))
    assert params["model_type"] == "flux2-klein" and params["steps"] == 2 and params["negative_prompt"] == "blurry"


def test_the_comfyui_file_loads_in_generate(klein: Path, run: Path, tmp_path: Path) -> None:
    diffusers = _generate(klein, tmp_path / "diffusers", "--lora", run / "pytorch_lora_weights.safetensors")
    comfy = _generate(klein, tmp_path / "comfy", "--lora", run / "pytorch_lora_weights_comfyui.safetensors")
    assert np.abs(comfy - diffusers).max() <= 1


def test_reference_images_edit_at_the_first_ones_size(klein: Path, tmp_path: Path) -> None:
    Image.new("RGB", (96, 64), "orange").save(tmp_path / "a.png")
    Image.new("RGB", (64, 64), "navy").save(tmp_path / "b.png")
    assert run_cli("generate", "flux2-klein", "--model", klein, "--prompt", "make it night", "--steps", "2",
                   "--image", tmp_path / "a.png", tmp_path / "b.png", "--seed", "1",
                   "--output_dir", tmp_path / "out") == 0
    (png,) = (tmp_path / "out").glob("*.png")
    assert Image.open(png).size == (96, 64)


def test_dev_generates_and_refuses_a_negative_prompt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dev = write_tiny_model("flux2", tmp_path / "dev")
    assert run_cli("generate", "flux2", "--model", dev, "--prompt", PROMPT, "--steps", "2", "--width", "32",
                   "--height", "32", "--output_dir", tmp_path / "out") == 0
    assert "--negative_prompt: FLUX.2 [dev] is guidance-distilled" in error_line(
        capsys, "generate", "flux2", "--model", dev, "--prompt", PROMPT, "--negative_prompt", "x")


def test_the_wrong_variant_or_family_is_named(klein: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = error_line(capsys, "generate", "flux2", "--model", klein, "--prompt", PROMPT)
    assert "a Flux2KleinPipeline folder; generate with it as 'dreamstep generate flux2-klein'" in line
    flux = write_tiny_model("flux", tmp_path / "flux1")
    line = error_line(capsys, "generate", "flux2-klein", "--model", flux, "--prompt", PROMPT)
    assert line.startswith("error: --model ") and "a FluxPipeline folder (FLUX.1" in line
    assert not (tmp_path / "outputs").exists()


def test_eval_scores_the_run_against_the_base(klein: Path, run: Path, tiny_evaluators: dict[str, Path],
                                              tmp_path: Path) -> None:
    out = tmp_path / "eval"
    assert run_cli("eval", "flux2-klein", "--model", klein, "--weights", run, "--prompt", PROMPT,
                   "--metrics", "clip_t", "--output_dir", out, "--num_images", "1", "--steps", "1",
                   "--resolution", "32", "--clip_model", tiny_evaluators["clip"]) == 0
    rows = {r["label"]: r for r in json.loads((out / "scores.json").read_text())["candidates"]}
    assert list(rows)[0] == "base model" and len(rows) >= 3, list(rows)
    assert any("checkpoint-4" in label for label in rows) and any("out" in label for label in rows)
    assert all(isinstance(r["clip_t"], float) for r in rows.values())
