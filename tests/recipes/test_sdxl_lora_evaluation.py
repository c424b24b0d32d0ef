"""Evaluation in `dreamstep train sdxl-lora` (a dataset TOML's is_validation subset, scores of the sample
prompts every --validate_every_n_steps) and `dreamstep eval sdxl` on its LoRA files and checkpoints."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from sdxl_testkit import run_cli, write_images, write_method


@pytest.fixture(scope="module")
def run(tiny_sdxl_dir: Path, tiny_evaluators: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sdxl_eval")
    toml = write_method(root, "class_tokens")
    validation = root / "validation"
    write_images(validation, count=2, seed=7)
    toml.write_text(toml.read_text() + f"\n  [[datasets.subsets]]\nimage_dir = '{validation.as_posix()}'\n"
                                       "class_tokens = 'sks dog'\nis_validation = true\n")
    (root / "prompts.txt").write_text("a photo of sks dog --w 64 --h 64 --s 2\n")
    out = root / "out"
    code = run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config", toml,
                   "--output_dir", out, "--max_train_steps", "2", "--learning_rate", "1e-3", "--network_dim", "4",
                   "--network_alpha", "2", "--save_every_n_steps", "1", "--save_state", "--log_with", "none",
                   "--seed", "0", "--sample_prompts", root / "prompts.txt", "--validate_every_n_steps", "1",
                   "--eval_metrics", "clip_i,clip_t", "--clip_model", tiny_evaluators["clip"])
    assert code == 0
    return out


def test_scores_at_every_validation_point(run: Path, capsys) -> None:
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert list(rows[0]) == ["step", "val_loss", "clip_i", "clip_t"]
    assert all(float(r["val_loss"]) > 0 for r in rows)
    assert (run / "metrics.png").is_file() and (run / "loss_curve.png").is_file()


def test_eval_scores_lora_files_and_checkpoints(run: Path, tiny_sdxl_dir: Path, tiny_evaluators: dict[str, Path],
                                                tmp_path: Path) -> None:
    out = tmp_path / "eval"
    code = run_cli("eval", "sdxl", "--model", tiny_sdxl_dir, "--weights", run, "--prompt", "a photo of sks dog",
                   "--instance_data_dir", run.parent / "butterfly", "--metrics", "clip_i,clip_t",
                   "--output_dir", out, "--num_images", "1", "--steps", "2", "--resolution", "64",
                   "--clip_model", tiny_evaluators["clip"])
    assert code == 0
    rows = {r["label"]: r for r in json.loads((out / "scores.json").read_text())["candidates"]}
    assert {"base model", "out/checkpoint-1", "out/checkpoint-2", "out/last-step00000001.safetensors",
            "out/last.safetensors"} == set(rows)
    assert rows["out/last-step00000001.safetensors"]["step"] == 1 and rows["out/last.safetensors"]["step"] == 2
    # A --save_state checkpoint holds the network in sd-scripts' names: it scores as the file of its step.
    assert rows["out/checkpoint-1"]["clip_i"] == pytest.approx(rows["out/last-step00000001.safetensors"]["clip_i"])
    assert rows["out/checkpoint-2"]["clip_t"] == pytest.approx(rows["out/last.safetensors"]["clip_t"])
    assert (out / "clip_i.png").is_file() and (out / "scores.csv").is_file()
