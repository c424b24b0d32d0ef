"""Evaluation in `dreamstep train flux-controlnet` (a held-out fraction of the pairs, edge agreement of the
validation samples) and `dreamstep eval flux` on its checkpoints and its saved ControlNet."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxControlNetModel, FluxTransformer2DModel
from flux_testkit import run_cli
from PIL import Image
from test_flux_controlnet import make_pairs

from dreamstep.evaluation.candidates import controlnet_source
from dreamstep.models.flux.generation import controlnet_from_checkpoint

PROMPT = "a red square"


@pytest.fixture(scope="module")
def run(tiny_flux_dev_dir: Path, tiny_evaluators: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    pairs = make_pairs(tmp_path_factory.mktemp("pairs"))
    out = pairs / "out"
    code = run_cli("train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                   "--train_data_dir", pairs / "images", "--conditioning_data_dir", pairs / "conditioning",
                   "--output_dir", out, "--resolution", "32", "--num_double_layers", "1", "--num_single_layers", "1",
                   "--report_to", "none", "--max_train_steps", "2", "--checkpointing_steps", "1",
                   "--validation_steps", "1", "--validation_split", "0.25", "--validation_prompt", PROMPT,
                   "--validation_image", pairs / "conditioning" / "pair_0.png", "--num_validation_images", "1",
                   "--validation_inference_steps", "1", "--eval_metrics", "edge,clip_t", "--eval_best_by", "edge",
                   "--clip_model", tiny_evaluators["clip"])
    assert code == 0
    return out


def test_val_loss_and_edge_agreement_are_logged(run: Path) -> None:
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert list(rows[0]) == ["step", "val_loss", "clip_t", "edge"]
    assert all(0.0 <= float(r["edge"]) <= 1.0 for r in rows)


def test_eval_scores_controlnet_checkpoints_and_folder(run: Path, tiny_flux_dev_dir: Path,
                                                       tiny_evaluators: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "eval"
    code = run_cli("eval", "flux", "--model", tiny_flux_dev_dir, "--weights", run, "--prompt", PROMPT,
                   "--control_image", run.parent / "conditioning" / "pair_0.png", "--metrics", "edge,clip_t",
                   "--output_dir", out, "--num_images", "1", "--steps", "1", "--resolution", "32",
                   "--clip_model", tiny_evaluators["clip"])
    assert code == 0
    summary = json.loads((out / "scores.json").read_text())
    rows = {r["label"]: r for r in summary["candidates"]}
    assert list(rows) == ["base model", "out/checkpoint-1", "out/checkpoint-2", "out"]
    assert rows["out"]["step"] == 2
    assert rows["out/checkpoint-2"]["edge"] == pytest.approx(rows["out"]["edge"])
    assert rows["out/checkpoint-2"]["clip_t"] == pytest.approx(rows["out"]["clip_t"])
    assert summary["best_by"] == "edge" and (out / "edge.png").is_file()


def test_generate_takes_the_last_checkpoint_as_the_saved_controlnet(run: Path, tiny_flux_dev_dir: Path,
                                                                   tmp_path: Path) -> None:
    images = []
    for name, controlnet in (("checkpoint", run / "checkpoint-2"), ("folder", run)):
        assert run_cli("generate", "flux", "--model", tiny_flux_dev_dir, "--controlnet", controlnet, "--control_image",
                       run.parent / "conditioning" / "pair_0.png", "--prompt", PROMPT, "--steps", "1", "--seed", "3",
                       "--width", "32", "--height", "32", "--output_dir", tmp_path / name) == 0
        (image,) = (tmp_path / name).glob("*.png")
        images.append(np.asarray(Image.open(image)))
    assert np.array_equal(*images)
    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux_dev_dir, subfolder="transformer")
    checkpoint = controlnet_source(str(run / "checkpoint-2"), tmp_path)
    built = controlnet_from_checkpoint(checkpoint.path, checkpoint.config_dir, transformer, torch.float32).state_dict()
    saved = FluxControlNetModel.from_pretrained(run).state_dict()
    assert built.keys() == saved.keys() and all(torch.equal(built[k], saved[k]) for k in saved)
