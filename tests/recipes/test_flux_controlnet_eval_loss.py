"""`dreamstep eval flux --metrics val_loss` on a flux-controlnet run: the validation loss of each checkpoint, of the
saved ControlNet and of the base model equals what the trainer logged, so eval names the checkpoint the trainer
named best; `generate --controlnet` takes that checkpoint (and the run folder with the same EMA choice)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flux_testkit import run_cli
from PIL import Image
from test_flux_controlnet import make_pairs

PROMPT = "a red square"
EVAL = ("--prompt", PROMPT, "--num_images", "1", "--steps", "1", "--resolution", "32")


@pytest.fixture(scope="module")
def run(tiny_flux_dev_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps with an EMA (validated with it), checkpoints and validation every 2 steps, half the pairs held out
    (2, one batch of 2); trained from inside the pairs' folder with relative paths, as a user types them."""
    pairs = make_pairs(tmp_path_factory.mktemp("pairs"))
    with contextlib.chdir(pairs):
        code = run_cli("train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                       "--train_data_dir", "images", "--conditioning_data_dir", "conditioning", "--output_dir",
                       "runs/cn", "--resolution", "32", "--num_double_layers", "1", "--num_single_layers", "1",
                       "--report_to", "none", "--max_train_steps", "4", "--checkpointing_steps", "2",
                       "--validation_steps", "2", "--validation_split", "0.5", "--train_batch_size", "2",
                       "--learning_rate", "1e-2", "--ema_decay", "0.5", "--seed", "3")
    assert code == 0
    return pairs / "runs" / "cn"


def _logged(run: Path) -> dict[int, float]:
    """The trainer's val_loss per step, at full precision (the last checkpoint's metrics table)."""
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    return {step: row["val_loss"] for step, row in state["extra"]["metrics"]}


def _trainer_best(run: Path) -> str:
    """The checkpoint the trainer named best (its train.log's "best by val_loss: step N ... -> .../checkpoint-N")."""
    line = next(li for li in (run / "train.log").read_text().splitlines() if "best by val_loss" in li)
    return re.search(r"-> \S*?(checkpoint-\d+)$", line).group(1)


def test_eval_val_loss_equals_the_trainers(run: Path, tiny_flux_dev_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not where training ran: the run's relative data paths are found all the same
    code = run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", run, "--metrics", "val_loss,edge",
                   "--control_image", run.parents[1] / "conditioning" / "pair_0.png", "--output_dir", "eval", *EVAL)
    assert code == 0
    summary = json.loads((tmp_path / "eval" / "scores.json").read_text())
    rows = {r["label"]: r for r in summary["candidates"]}
    assert list(rows) == ["base model", "cn/checkpoint-2 (ema)", "cn/checkpoint-4 (ema)", "cn (ema)"]
    logged = _logged(run)
    assert len(set(logged.values())) == 3  # the weights moved: three different losses to match
    # the checkpoints' as logged at their steps, the base model's as step 0's (a built ControlNet adds zero)
    eval_loss = {row["step"]: row["val_loss"] for label, row in rows.items() if label != "cn (ema)"}
    assert eval_loss == pytest.approx(logged, rel=1e-6, abs=1e-7)
    assert rows["cn (ema)"]["val_loss"] == pytest.approx(logged[4], rel=1e-6)  # the saved EMA: the last step's
    assert summary["best_by"] == "val_loss"
    assert summary["best"] == f"cn/{_trainer_best(run)} (ema)"  # on a tie the checkpoint comes first
    assert (tmp_path / "eval" / "val_loss.png").is_file()


def test_raw_weights_are_scored_when_asked(run: Path, tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    code = run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", run / "checkpoint-2", "--metrics",
                   "val_loss", "--checkpoint_weights", "raw", "--output_dir", tmp_path, "--control_image",
                   run.parents[1] / "conditioning" / "pair_0.png", *EVAL)
    assert code == 0
    rows = {r["label"]: r for r in json.loads((tmp_path / "scores.json").read_text())["candidates"]}
    raw = rows["cn/checkpoint-2 (raw)"]["val_loss"]
    assert np.isfinite(raw) and raw != pytest.approx(_logged(run)[2], rel=1e-6)  # the EMA is what the run scored


def test_val_loss_refusals(run: Path, tiny_flux_dev_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    def refused(weights: Path, *more: object) -> str:
        assert run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", weights, "--metrics", "val_loss",
                       "--output_dir", tmp_path / "eval", *EVAL, *more) == 2
        return capsys.readouterr().err

    assert "give --control_image" in refused(run / "checkpoint-2")
    control = ("--control_image", run.parents[1] / "conditioning" / "pair_0.png")
    # a ControlNet folder with no run: no held-out pairs to score
    assert "--metrics val_loss is the held-out loss a run logged" in refused(run / "ema", *control)
    # a run whose data is not where its config.toml says (moved away from the folder training ran in)
    moved = tmp_path / "moved"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("cache", "samples"))
    assert f"{moved / 'config.toml'}'s data" in refused(moved, *control)
    # a run that held nothing out
    (moved / "config.toml").write_text((moved / "config.toml").read_text().replace("validation_split = 0.5",
                                                                                   "validation_split = 0.0"))
    shutil.copytree(run.parents[1] / "images", tmp_path / "images")
    shutil.copytree(run.parents[1] / "conditioning", tmp_path / "conditioning")
    assert "held out no images" in refused(moved, *control)
    assert not (tmp_path / "eval").exists()


def test_generate_takes_the_best_checkpoint_and_the_runs_ema(run: Path, tiny_flux_dev_dir: Path,
                                                             tmp_path: Path) -> None:
    images = {}
    for name in (_trainer_best(run), "", "ema"):
        out = tmp_path / (name or "run")
        assert run_cli("generate", "flux", "--model", tiny_flux_dev_dir, "--controlnet", run / name,
                       "--control_image", run.parents[1] / "conditioning" / "pair_0.png", "--prompt", PROMPT,
                       "--steps", "1", "--seed", "3", "--width", "32", "--height", "32", "--output_dir", out) == 0
        (image,) = out.glob("*.png")
        images[name] = np.asarray(Image.open(image))
    assert np.array_equal(images[""], images["ema"])  # the run validated with its EMA: its folder gives the EMA


def test_checkpoints_of_a_run_that_continued_a_controlnet(run: Path, tiny_flux_dev_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A run started from a ControlNet (--controlnet_model_name_or_path, a relative folder; its block counts are not
    the flags' defaults): its checkpoint is shaped as that one, in eval and generate, also before the run wrote its
    own config.json."""
    pairs = run.parents[1]
    with contextlib.chdir(pairs):
        assert run_cli("train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                       "--train_data_dir", "images", "--conditioning_data_dir", "conditioning", "--output_dir",
                       "runs/continued", "--controlnet_model_name_or_path", "runs/cn/ema", "--resolution", "32",
                       "--report_to", "none", "--max_train_steps", "2", "--checkpointing_steps", "2",
                       "--validation_steps", "2", "--validation_split", "0.25", "--learning_rate", "1e-2") == 0
    continued = pairs / "runs" / "continued"
    (continued / "config.json").unlink()  # as a run still training has none yet
    monkeypatch.chdir(tmp_path)
    control = ("--control_image", pairs / "conditioning" / "pair_0.png")
    assert run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", continued / "checkpoint-2", "--metrics",
                   "val_loss", "--output_dir", "eval", *control, *EVAL) == 0
    rows = json.loads((tmp_path / "eval" / "scores.json").read_text())["candidates"]
    state = json.loads((continued / "checkpoint-2" / "trainer_state.json").read_text())
    assert rows[1]["val_loss"] == pytest.approx(dict(state["extra"]["metrics"])[2]["val_loss"], rel=1e-6)
    assert run_cli("generate", "flux", "--model", tiny_flux_dev_dir, "--controlnet", continued / "checkpoint-2",
                   *control, "--prompt", PROMPT, "--steps", "1", "--width", "32", "--height", "32",
                   "--output_dir", "generated") == 0
