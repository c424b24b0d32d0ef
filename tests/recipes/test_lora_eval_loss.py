"""`dreamstep eval --metrics val_loss` on LoRA runs (flux-lora, sdxl-lora): the validation loss of each checkpoint,
of the saved LoRA and of the base model equals what the trainer logged, recomputed by the trainer's own step on the
images the run held out, so `--best_by val_loss` names the step the trainer named best."""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import pytest
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, write_control_pairs
from sdxl_testkit import run_cli, write_images


def _logged(run: Path, last: int) -> dict[int, float]:
    """The trainer's val_loss per step, at full precision (the last checkpoint's metrics table)."""
    state = json.loads((run / f"checkpoint-{last}" / "trainer_state.json").read_text())
    return {step: row["val_loss"] for step, row in state["extra"]["metrics"]}


def _trainer_best_step(run: Path) -> int:
    line = next(li for li in (run / "train.log").read_text().splitlines() if "best by val_loss" in li)
    return int(re.search(r"best by val_loss: step (\d+)", line).group(1))


def _eval(model_type: str, model: Path, weights: Path, out: Path, size: int, *more: object) -> dict:
    assert run_cli("eval", model_type, "--model", model, "--weights", weights, "--metrics", "val_loss",
                   "--prompt", "a photo", "--num_images", "1", "--steps", "1", "--resolution", size,
                   "--output_dir", out, *more) == 0
    return json.loads((out / "scores.json").read_text())


@pytest.fixture(scope="module")
def flux_run(tiny_flux_dev_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps, a third of the 6 robots held out, checkpoints and validation every 2 steps; CLIP trains too, and an
    EMA, which the run validates with."""
    out = tmp_path_factory.mktemp("flux_lora_loss") / "run"
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--output_dir", out,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
                   "--center_crop", "--report_to", "none", "--rank", "4", "--lora_alpha", "2",
                   "--learning_rate", "1e-2", "--validation_split", "0.34", "--validation_steps", "2",
                   "--checkpointing_steps", "2", "--max_train_steps", "4", "--train_text_encoder",
                   "--ema_decay", "0.9", "--seed", "5") == 0
    return out


def test_flux_lora_eval_val_loss_equals_the_trainers(flux_run: Path, tiny_flux_dev_dir: Path,
                                                     tmp_path: Path) -> None:
    summary = _eval("flux", tiny_flux_dev_dir, flux_run, tmp_path / "eval", 32)
    rows = {r["label"]: r for r in summary["candidates"]}
    # the run validated with its EMA: of its final files, the EMA's (the raw one only with --checkpoint_weights raw)
    assert list(rows) == ["base model", "run/checkpoint-2 (ema)", "run/checkpoint-4 (ema)",
                          "run/pytorch_lora_weights_ema.safetensors"]
    logged = _logged(flux_run, 4)
    assert len(set(logged.values())) == 3  # the weights moved: three different losses to match
    eval_loss = {r["step"]: r["val_loss"] for label, r in rows.items() if "checkpoint" in label or r["step"] == 0}
    assert eval_loss == pytest.approx(logged, rel=1e-5, abs=1e-6)
    assert rows["run/pytorch_lora_weights_ema.safetensors"]["val_loss"] == pytest.approx(logged[4], rel=1e-5)
    assert summary["best_by"] == "val_loss"
    assert summary["best"] == f"run/checkpoint-{_trainer_best_step(flux_run)} (ema)"  # on a tie the checkpoint


def test_a_checkpoint_alone_raw_weights_and_a_loose_file(flux_run: Path, tiny_flux_dev_dir: Path,
                                                         tmp_path: Path) -> None:
    loose = tmp_path / "loose.safetensors"
    shutil.copy(flux_run / "pytorch_lora_weights.safetensors", loose)
    summary = _eval("flux", tiny_flux_dev_dir, flux_run / "checkpoint-2", tmp_path / "eval", 32,
                    "--weights", loose)
    rows = {r["label"]: r for r in summary["candidates"]}
    assert rows["run/checkpoint-2 (ema)"]["val_loss"] == pytest.approx(_logged(flux_run, 4)[2], rel=1e-5)
    raw = _eval("flux", tiny_flux_dev_dir, flux_run, tmp_path / "raw", 32, "--checkpoint_weights", "raw")
    labels = [r["label"] for r in raw["candidates"]]
    assert labels[1:] == ["run/checkpoint-2 (raw)", "run/checkpoint-4 (raw)", "run/pytorch_lora_weights.safetensors"]
    last, final = raw["candidates"][2:]
    assert last["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6)  # the raw weights, as the run saved them
    assert last["val_loss"] != pytest.approx(_logged(flux_run, 4)[4], rel=1e-5)  # the EMA is what the run scored
    assert rows["loose.safetensors"]["val_loss"] != rows["loose.safetensors"]["val_loss"]  # nan: from no run


def test_flux_kontext_lora_eval_val_loss_equals_the_trainers(tiny_flux_kontext_dir: Path, tmp_path: Path) -> None:
    """The same path for an edit model: the held-out pairs' targets scored beside their "before" images."""
    images, conditioning = write_control_pairs(tmp_path / "pairs")
    run = tmp_path / "kontext"
    assert run_cli("train", "flux-kontext-lora", "--pretrained_model_name_or_path", tiny_flux_kontext_dir,
                   "--output_dir", run, "--instance_data_dir", images, "--conditioning_data_dir", conditioning,
                   "--resolution", "32", "--max_sequence_length", "16", "--report_to", "none", "--rank", "4",
                   "--learning_rate", "1e-2", "--max_train_steps", "2", "--checkpointing_steps", "1",
                   "--validation_steps", "1", "--validation_split", "0.25") == 0
    summary = _eval("flux-kontext", tiny_flux_kontext_dir, run, tmp_path / "eval", 32, "--image",
                    conditioning / "0.png")
    eval_loss = {r["step"]: r["val_loss"] for r in summary["candidates"] if "checkpoint" in r["label"]
                 or r["step"] == 0}
    logged = _logged(run, 2)
    assert len(set(logged.values())) == 3
    assert eval_loss == pytest.approx(logged, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(("trainer", "testkit", "model_type"), [
    ("flux2-lora", "flux2_testkit", "flux2-klein"), ("z-image-lora", "z_image_testkit", "z-image"),
    ("krea2-lora", "krea2_testkit", "krea2"), ("qwen-image-lora", "qwen_image_testkit", "qwen-image")])
def test_every_dit_lora_run_gives_its_logged_val_loss(trainer: str, testkit: str, model_type: str,
                                                      tmp_path: Path) -> None:
    """The same shared path for the families on the family protocol: their testkits' smallest run, two steps
    with a checkpoint and validation at each and a third of the robots held out."""
    options = importlib.import_module(testkit).smallest_run(trainer, tmp_path) | {
        "max_train_steps": "2", "checkpointing_steps": "1", "validation_steps": "1", "validation_split": "0.34",
        "learning_rate": "1e-2"}
    assert run_cli("train", trainer, *[a for k, v in options.items() for a in (f"--{k}", v)]) == 0
    run = Path(options["output_dir"])
    summary = _eval(model_type, Path(options["pretrained_model_name_or_path"]), run, tmp_path / "eval", 32)
    eval_loss = {r["step"]: r["val_loss"] for r in summary["candidates"] if "checkpoint" in r["label"]
                 or r["step"] == 0}
    logged = _logged(run, 2)
    assert len(set(logged.values())) == 3
    assert eval_loss == pytest.approx(logged, rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def sdxl_run(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 steps of an sd-scripts-style run with a quarter of 4 images held out, a --save_state checkpoint and
    validation every step; the text encoders train too (sd-scripts' default)."""
    root = tmp_path_factory.mktemp("sdxl_lora_loss")
    write_images(root / "images" / "1_sks dog", count=4, seed=3)
    out = root / "out"
    assert run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--train_data_dir",
                   root / "images", "--output_dir", out, "--resolution", "64", "--max_train_steps", "3",
                   "--learning_rate", "1e-2", "--network_dim", "4", "--network_alpha", "2",
                   "--save_every_n_steps", "1", "--save_state", "--log_with", "none", "--seed", "0",
                   "--validation_split", "0.25", "--validate_every_n_steps", "1") == 0
    return out


def test_sdxl_lora_eval_val_loss_equals_the_trainers(sdxl_run: Path, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    summary = _eval("sdxl", tiny_sdxl_dir, sdxl_run, tmp_path / "eval", 64)
    rows = {r["label"]: r for r in summary["candidates"]}
    logged = _logged(sdxl_run, 3)
    assert len(set(logged.values())) == 4
    eval_loss = {r["step"]: r["val_loss"] for label, r in rows.items() if "checkpoint" in label or r["step"] == 0}
    assert eval_loss == pytest.approx(logged, rel=1e-5, abs=1e-6)
    assert rows["out/last.safetensors"]["val_loss"] == pytest.approx(logged[3], rel=1e-5)
    best = next(r for r in summary["candidates"] if r["label"] == summary["best"])
    assert best["step"] == _trainer_best_step(sdxl_run)


def test_a_run_that_held_out_nothing_is_one_line(sdxl_run: Path, tiny_sdxl_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    moved = tmp_path / "out"
    shutil.copytree(sdxl_run, moved, ignore=shutil.ignore_patterns("cache", "sample"))
    toml = moved / "config.toml"
    toml.write_text(re.sub(r"validation_split = [0-9.]+", "validation_split = 0.0", toml.read_text()))
    assert run_cli("eval", "sdxl", "--model", tiny_sdxl_dir, "--weights", moved, "--metrics", "val_loss",
                   "--prompt", "x", "--output_dir", tmp_path / "eval") == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "held out no images" in error and "--validation_split" in error
    assert not (tmp_path / "eval").exists()


def test_a_run_of_a_trainer_eval_cannot_score_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A Qwen-Image-Edit run (eval has no edit variant of Qwen-Image to score it with) is named, before anything
    loads."""
    testkit = importlib.import_module("qwen_image_testkit")
    options = testkit.smallest_run("qwen-image-edit-lora", tmp_path)
    assert run_cli("train", "qwen-image-edit-lora", *[a for k, v in options.items() for a in (f"--{k}", v)]) == 0
    assert run_cli("eval", "qwen-image", "--model", testkit.tiny_model("qwen-image", tmp_path), "--weights",
                   options["output_dir"], "--metrics", "val_loss", "--prompt", "x", "--output_dir",
                   tmp_path / "eval") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is a qwen-image-edit-lora run, whose validation loss eval does not recompute; drop val_loss" in error
    assert not (tmp_path / "eval").exists()
