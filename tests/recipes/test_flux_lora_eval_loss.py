"""`dreamstep eval flux --metrics val_loss` on a flux-lora run: the validation loss of each checkpoint, of the
saved LoRA and of the base model equals what the trainer logged (CLIP's LoRA included, for a run that trained
it), so eval names the checkpoint the trainer named best."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli

from dreamstep.models.tiny import write_tiny_model

EVAL = ("--prompt", ROBOT_PROMPT, "--num_images", "1", "--steps", "1", "--resolution", "32")


def _train(model: Path, out: Path, *extra: object) -> Path:
    """4 steps, checkpoints and the validation loss every 2 steps on the held-out robot images."""
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", model, "--output_dir", out,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
                   "--center_crop", "--report_to", "none", "--rank", "4", "--lora_alpha", "2", "--learning_rate",
                   "1e-2", "--validation_data_dir", ROBOT_DIR, "--validation_steps", "2", "--checkpointing_steps",
                   "2", "--max_train_steps", "4", "--seed", "3", *extra) == 0
    return out


def _logged(run: Path) -> dict[int, float]:
    """The trainer's val_loss per step, at full precision (the last checkpoint's metrics table)."""
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    return {step: row["val_loss"] for step, row in state["extra"]["metrics"]}


def _trainer_best(run: Path) -> str:
    line = next(li for li in (run / "train.log").read_text().splitlines() if "best by val_loss" in li)
    return re.search(r"-> \S*?(checkpoint-\d+)$", line).group(1)


def _eval(model: Path, weights: Path, out: Path) -> dict:
    assert run_cli("eval", "flux", "--model", model, "--weights", weights, "--metrics", "val_loss", "--output_dir",
                   out, *EVAL) == 0
    return json.loads((out / "scores.json").read_text())


@pytest.mark.parametrize("extra", [(), ("--train_text_encoder",)], ids=["transformer", "with-clip"])
def test_eval_val_loss_equals_the_trainers(extra: tuple[str, ...], tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    run = _train(tiny_flux_dev_dir, tmp_path / "run", *extra)
    summary = _eval(tiny_flux_dev_dir, run, tmp_path / "eval")
    rows = {r["label"]: r for r in summary["candidates"]}
    assert list(rows) == ["base model", "run/checkpoint-2", "run/checkpoint-4", "run/pytorch_lora_weights.safetensors"]
    logged = _logged(run)
    assert len(set(logged.values())) == 3  # the LoRA moved: three different losses to match
    eval_loss = {row["step"]: row["val_loss"] for label, row in rows.items() if not label.endswith(".safetensors")}
    assert eval_loss == pytest.approx(logged, rel=1e-5)  # the base model's as step 0's (a new LoRA adds zero)
    assert rows["run/pytorch_lora_weights.safetensors"]["val_loss"] == pytest.approx(logged[4], rel=1e-5)
    assert summary["best"] == f"run/{_trainer_best(run)}"


def test_val_loss_of_runs_eval_cannot_score_is_one_line(tiny_flux_dev_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    run = _train(tiny_flux_dev_dir, tmp_path / "run", "--max_train_steps", "2", "--validation_steps", "0")
    lone = tmp_path / "lone.safetensors"
    shutil.copy(run / "pytorch_lora_weights.safetensors", lone)
    other = tmp_path / "other_run"  # a run of a trainer whose loss eval does not recompute (flux-kohya's keys)
    other.mkdir()
    shutil.copy(lone, other / "last.safetensors")
    (other / "config.toml").write_text('network_dim = 4\npretrained_model_name_or_path = "x"\n')
    no_held_out = tmp_path / "no_held_out"
    shutil.copytree(run, no_held_out)
    config = no_held_out / "config.toml"
    config.write_text(re.sub(r'(?m)^validation_data_dir = .*$', "", config.read_text()))
    capsys.readouterr()
    for weights, said in ((lone, "give a run folder or its checkpoint-N folders"),
                          (other, "is not a run of flux-lora or flux-controlnet, the FLUX.1 trainers"),
                          (no_held_out, "held out nothing")):
        assert run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", weights, "--metrics", "val_loss",
                       "--output_dir", tmp_path / "eval", *EVAL) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and err.count("\n") == 1, err
        assert not (tmp_path / "eval").exists()


def test_val_loss_of_a_family_eval_does_not_recompute_is_one_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    model = write_tiny_model("z-image", tmp_path / "z-image", seed=0)
    lora = tmp_path / "any.safetensors"
    lora.write_bytes(b"never read: the metric is refused first")
    capsys.readouterr()
    assert run_cli("eval", "z-image", "--model", model, "--weights", lora, "--metrics", "val_loss", "--prompt", "x",
                   "--output_dir", tmp_path / "eval") == 2
    assert capsys.readouterr().err == ("error: --metrics val_loss: eval does not recompute the validation loss of "
                                       "Z-Image runs (their train.log and metrics.csv have it); drop val_loss\n")
    assert not (tmp_path / "eval").exists()
