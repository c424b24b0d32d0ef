"""Evaluation in `dreamstep train flux-lora` and `dreamstep eval flux` on the tiny FLUX and the tiny random
DINO / CLIP: the validation loss falls when training on the validation images, is identical after resume,
lands in metrics.csv, metrics.png and the loss curve; `dreamstep eval` ranks the checkpoints against the
base model and writes its tables and plots."""

from __future__ import annotations

import csv
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli
from PIL import Image
from safetensors.torch import load_file, save_file

STEPS = ("--validation_steps", "3", "--checkpointing_steps", "3")


def _train_args(model: Path, evaluators: dict[str, Path], out: Path, *extra: object) -> list[object]:
    return ["train", "flux-lora", "--pretrained_model_name_or_path", model, "--output_dir", out,
            "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
            "--center_crop", "--report_to", "none", "--rank", "4", "--lora_alpha", "2", "--learning_rate", "1e-2",
            "--validation_data_dir", ROBOT_DIR, "--validation_prompt", ROBOT_PROMPT, "--num_validation_images", "1",
            "--validation_inference_steps", "1", "--eval_metrics", "dino,clip_i,clip_t",
            "--dino_model", evaluators["dino"], "--clip_model", evaluators["clip"], *STEPS, *extra]


def _metrics(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def trained(tiny_flux_dev_dir: Path, tiny_evaluators: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flux_eval") / "run"
    assert run_cli(*_train_args(tiny_flux_dev_dir, tiny_evaluators, out, "--max_train_steps", "6")) == 0
    return out


def test_validation_loss_falls_on_the_trained_images_and_is_written(trained: Path, capsys) -> None:
    rows = _metrics(trained)
    assert list(rows[0]) == ["step", "val_loss", "dino", "clip_i", "clip_t"]
    assert [r["step"] for r in rows] == ["0", "3", "6"]
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"])
    for name in ("metrics.png", "loss_curve.png", "checkpoint-3", "checkpoint-6"):
        assert (trained / name).exists(), name


def test_resume_gives_the_same_scores(trained: Path, tiny_flux_dev_dir: Path, tiny_evaluators: dict[str, Path],
                                      tmp_path: Path, capsys) -> None:
    out = tmp_path / "resumed"
    assert run_cli(*_train_args(tiny_flux_dev_dir, tiny_evaluators, out, "--max_train_steps", "3")) == 0
    assert run_cli(*_train_args(tiny_flux_dev_dir, tiny_evaluators, out, "--max_train_steps", "6",
                                "--resume_from_checkpoint", "latest")) == 0
    rows = _metrics(out)
    assert rows == _metrics(trained)
    best = min(rows, key=lambda r: float(r["val_loss"]))["step"]
    printed = capsys.readouterr().out
    assert f"best by val_loss: step {best}:" in printed and "final: step 6:" in printed


def test_eval_ranks_checkpoints_against_the_base_model(trained: Path, tiny_flux_dev_dir: Path,
                                                       tiny_evaluators: dict[str, Path], tmp_path: Path,
                                                       capsys) -> None:
    out = tmp_path / "eval"
    code = run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", trained, "--prompt", ROBOT_PROMPT,
                   "--instance_data_dir", ROBOT_DIR, "--output_dir", out, "--num_images", "1", "--steps", "1",
                   "--resolution", "32", "--dino_model", tiny_evaluators["dino"], "--clip_model",
                   tiny_evaluators["clip"], "--best_by", "clip_t")
    assert code == 0
    summary = json.loads((out / "scores.json").read_text())
    rows = {r["label"]: r for r in summary["candidates"]}
    assert list(rows) == ["base model", "run/checkpoint-3", "run/checkpoint-6", "run/pytorch_lora_weights.safetensors"]
    assert [r["step"] for r in rows.values()] == [0, 3, 6, 6]
    # A checkpoint (peft names, alpha 2 / rank 4 from the run's config) scores exactly as the final LoRA file.
    final, last = rows["run/pytorch_lora_weights.safetensors"], rows["run/checkpoint-6"]
    assert all(final[m] == pytest.approx(last[m], abs=1e-6) for m in ("dino", "clip_i", "clip_t"))
    assert rows["base model"]["dino"] != pytest.approx(final["dino"], abs=1e-6)  # the LoRA changes the samples
    for metric in ("dino", "clip_i", "clip_t"):
        values = {label: r[metric] for label, r in rows.items()}
        assert values[summary["best_per_metric"][metric]] == max(values.values())
        assert (out / f"{metric}.png").is_file()
    assert summary["best"] == summary["best_per_metric"]["clip_t"]
    with (out / "scores.csv").open() as f:
        assert next(csv.reader(f)) == ["label", "path", "step", "dino", "clip_i", "clip_t", "samples"]
    assert f"best by clip_t: {summary['best']}" in capsys.readouterr().out


def test_bad_evaluation_input_is_one_line(tiny_flux_dev_dir: Path, tiny_evaluators: dict[str, Path],
                                          tmp_path: Path, capsys) -> None:
    out = tmp_path / "never"
    args = _train_args(tiny_flux_dev_dir, tiny_evaluators, out, "--max_train_steps", "1")
    missing = [a if a != tiny_evaluators["dino"] else "nobody/no-such-dino" for a in args]
    assert run_cli(*missing) == 2
    assert run_cli(*args, "--eval_metrics", "dino,clip_x") == 2
    assert run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", tmp_path / "nothing.safetensors",
                   "--prompt", "x", "--metrics", "clip_t", "--output_dir", out) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "nobody/no-such-dino" in errors[0] and "--dino_model" in errors[0]
    assert "unknown metric 'clip_x'" in errors[1] and "clip_i" in errors[1]
    assert "nothing.safetensors: not found" in errors[2]
    assert len([e for e in errors if e.startswith("error:")]) == 3
    assert not out.exists()


def test_a_checkpoint_whose_weights_are_a_pickle_is_named_in_one_line(trained: Path, tiny_flux_dev_dir: Path,
                                                                      tmp_path: Path, capsys) -> None:
    damaged = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(trained / "checkpoint-3", damaged)
    torch.save({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8)},
               damaged / "trainable_weights.safetensors")
    (tmp_path / "run" / "config.toml").write_bytes((trained / "config.toml").read_bytes())
    out = tmp_path / "eval"
    assert run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", damaged, "--prompt", "x",
                   "--metrics", "clip_t", "--output_dir", out) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {damaged / 'trainable_weights.safetensors'}: a torch pickle, not the safetensors file a "
                   "checkpoint holds; it was not loaded (nothing in it ran)\n")
    assert not out.exists()


def test_a_checkpoint_or_run_folder_works_wherever_a_lora_file_does(trained: Path, tiny_flux_dev_dir: Path,
                                                                     tmp_path: Path, capsys) -> None:
    """The run's summary names checkpoint folders as the best steps: generate, lora info and convert take them
    (and a run folder, for its final LoRA) as they take a LoRA file."""
    final = trained / "pytorch_lora_weights.safetensors"
    assert run_cli("lora", "info", trained / "checkpoint-3") == 0
    out = capsys.readouterr().out
    assert out.startswith(f"from:      {trained / 'checkpoint-3'}\n") and "format:    diffusers-flux" in out
    assert run_cli("lora", "info", trained) == 0
    assert f"file:      {final} " in capsys.readouterr().out

    for source, name in ((trained / "checkpoint-6", "from_checkpoint"), (final, "from_file")):
        assert run_cli("convert", "lora", source, tmp_path / f"{name}.safetensors", "--to", "kohya") == 0
    from_checkpoint, from_file = (load_file(tmp_path / f"{n}.safetensors") for n in ("from_checkpoint", "from_file"))
    assert from_checkpoint.keys() == from_file.keys()
    assert all(torch.allclose(from_checkpoint[k].float(), from_file[k].float(), atol=1e-6) for k in from_file)

    images = {}
    for source, name in ((trained / "checkpoint-6", "checkpoint"), (trained, "run"), (final, "file")):
        assert run_cli("generate", "flux", "--model", tiny_flux_dev_dir, "--prompt", ROBOT_PROMPT, "--lora", source,
                       "--steps", "1", "--width", "32", "--height", "32", "--seed", "3",
                       "--output_dir", tmp_path / name) == 0
        images[name] = np.asarray(Image.open(next((tmp_path / name).glob("*.png"))))
    assert np.array_equal(images["checkpoint"], images["file"]) and np.array_equal(images["run"], images["file"])

    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "config.toml").write_text("rank = 4\n")
    capsys.readouterr()
    assert run_cli("lora", "info", tmp_path / "empty_run") == 2
    assert capsys.readouterr().err == (f"error: lora info {tmp_path / 'empty_run'}: a folder without a LoRA; give a "
                                       "LoRA file, a checkpoint-N folder of a LoRA run, or a LoRA run's folder\n")


class _RunsCode:
    """Unpickles as a call to print: a stand-in for a pickle that runs code."""

    def __reduce__(self):
        return print, ("PICKLED CODE RAN",)


def _with_pickled_weights(folder: Path, copy: Path) -> Path:
    """A copy of a model folder whose safetensors weights are replaced by a pickle that runs code."""
    shutil.copytree(folder, copy)
    weights = next(copy.glob("*.safetensors"))
    weights.unlink()
    (copy / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(), protocol=2))
    return copy / "pytorch_model.bin"


@pytest.mark.parametrize("part", ["clip", "dino", "text_encoder"])
def test_a_pickle_with_code_in_place_of_a_models_weights_is_one_line(part, tiny_flux_dev_dir: Path,
                                                                     tiny_evaluators: dict[str, Path],
                                                                     tmp_path: Path, capsys) -> None:
    model, evaluators = tiny_flux_dev_dir, dict(tiny_evaluators)
    if part == "text_encoder":
        shutil.copytree(tiny_flux_dev_dir, tmp_path / "model", ignore=shutil.ignore_patterns("text_encoder"))
        model = tmp_path / "model"
        pickled = _with_pickled_weights(tiny_flux_dev_dir / "text_encoder", model / "text_encoder")
        flag, source = "model", model
    else:
        evaluators[part] = tmp_path / part
        pickled = _with_pickled_weights(tiny_evaluators[part], evaluators[part])
        flag, source = f"--{part}_model", evaluators[part]
    out = tmp_path / "out"
    assert run_cli(*_train_args(model, evaluators, out, "--max_train_steps", "1")) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1] == (
        f"error: {flag} {source}: {pickled} holds objects other than tensors, which may run code, so it was not "
        "loaded (nothing in it ran); use the model's .safetensors weights")
    assert "PICKLED CODE RAN" not in captured.out + captured.err
    assert not out.exists()


def test_eval_refuses_another_models_lora_and_a_dino_model_as_clip_before_writing(
        trained: Path, tiny_flux_dev_dir: Path, tiny_evaluators: dict[str, Path], tmp_path: Path, capsys) -> None:
    sdxl_lora = tmp_path / "sdxl.safetensors"
    save_file({"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight": torch.zeros(4, 640),
               "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_up.weight": torch.zeros(640, 4)},
              str(sdxl_lora))
    out = tmp_path / "eval"
    base = ("eval", "flux", "--model", tiny_flux_dev_dir, "--prompt", ROBOT_PROMPT, "--output_dir", out)
    assert run_cli(*base, "--weights", trained / "checkpoint-3", sdxl_lora, "--metrics", "clip_t") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {sdxl_lora}: module 'lora_unet_input_blocks_4_1") and err.count("\n") == 1
    assert run_cli(*base, "--weights", trained / "checkpoint-3", "--metrics", "clip_t",
                   "--clip_model", tiny_evaluators["dino"]) == 2
    assert capsys.readouterr().err == (f"error: --clip_model {tiny_evaluators['dino']}: a 'vit' model, not the "
                                       "'clip' model this metric needs; give one like openai/clip-vit-base-patch32\n")
    # A folder that is no transformers model at all (a diffusers pipeline), in eval and in training.
    assert run_cli(*base, "--weights", trained / "checkpoint-3", "--metrics", "dino", "--instance_data_dir",
                   ROBOT_DIR, "--dino_model", tiny_flux_dev_dir) == 2
    assert capsys.readouterr().err == (f"error: --dino_model {tiny_flux_dev_dir}: not a transformers VIT model (no "
                                       "config.json with a model type there); give one like facebook/dino-vits16\n")
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--instance_data_dir",
                   ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--output_dir", out, "--validation_prompt", "a",
                   "--eval_metrics", "clip_t", "--clip_model", tiny_flux_dev_dir) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --clip_model {tiny_flux_dev_dir}: not a transformers CLIP") and err.count("\n") == 1
    assert not out.exists()
