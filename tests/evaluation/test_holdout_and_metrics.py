"""Held-out validation images and the per-run metrics table (metrics.csv, metrics.png, the best step)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dreamstep.data.dataset_config import parse_dataset_config
from dreamstep.data.holdout import build_split_datasets, subject_image_paths
from dreamstep.engine.metrics import MetricsTable, draw_metrics
from dreamstep.errors import UserError


def _images(folder: Path, count: int, seed: int) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


def _config(tmp_path: Path, validation_subset: bool = False) -> list:
    subsets = [{"image_dir": str(_images(tmp_path / "train", 6, 0)), "class_tokens": "sks dog", "num_repeats": 3},
               {"image_dir": str(_images(tmp_path / "reg", 4, 1)), "class_tokens": "dog", "is_reg": True}]
    if validation_subset:
        subsets.append({"image_dir": str(_images(tmp_path / "val", 2, 2)), "class_tokens": "sks dog",
                        "is_validation": True})
    return parse_dataset_config({"datasets": [{"resolution": 32, "subsets": subsets}]})


def test_a_fraction_is_held_out_the_same_way_every_time_and_never_trained_on(tmp_path: Path) -> None:
    configs = _config(tmp_path)
    train, held = build_split_datasets(configs, seed=0, validation_split=0.34)
    again, held_again = build_split_datasets(configs, seed=0, validation_split=0.34)
    held_paths = {r.image.path for r in held.records}
    assert len(held_paths) == 2 and held_paths == {r.image.path for r in held_again.records}
    assert not held_paths & {r.image.path for r in train.records}
    assert all(not r.subset.is_reg for r in held.records) and len(held) == 2  # once each, not num_repeats
    assert len(subject_image_paths(train, held)) == 6  # the subject's images: held out or not, no class images
    other_seed = {r.image.path for r in build_split_datasets(configs, seed=5, validation_split=0.5)[1].records}
    assert len(other_seed) == 3


def test_a_validation_subset_is_held_out_whole(tmp_path: Path) -> None:
    train, held = build_split_datasets(_config(tmp_path, validation_subset=True), seed=0)
    assert {r.image.path.parent.name for r in held.records} == {"val"}
    assert "val" not in {r.image.path.parent.name for r in train.records}
    assert build_split_datasets(_config(tmp_path / "none"), seed=0)[1] is None


def test_holding_out_everything_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--validation_split 0.95 would hold out all 6"):
        build_split_datasets(_config(tmp_path), seed=0, validation_split=0.95)


def test_metrics_table_picks_the_best_step_and_writes_csv_and_plot(tmp_path: Path) -> None:
    table = MetricsTable()
    for step, loss, dino in ((0, 1.0, 0.2), (10, 0.7, 0.5), (20, 0.8, 0.4)):
        table.add(step, {"val_loss": loss, "dino": dino})
    assert table.best("val_loss")[0] == 10 and table.best("dino")[0] == 10
    table.add(30, {"dino": 0.6})
    assert table.best("dino") == (30, {"dino": 0.6}) and table.best("val_loss")[0] == 10
    assert MetricsTable.from_state(table.state()).rows == table.rows
    with table.write_csv(tmp_path / "metrics.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "val_loss", "dino"] and rows[-1] == ["30", "", "0.6"]
    image = Image.open(draw_metrics(table, tmp_path / "metrics.png", marks={"dino": 30}))
    assert image.size == (840, 240)
