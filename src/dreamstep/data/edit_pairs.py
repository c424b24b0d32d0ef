"""The data of the edit trainers: pairs of a "before" (condition) image and an "after" image with an instruction,
from a dataset TOML, a metadata table (``--dataset_name``, diffusers' edit scripts' columns) or two folders
matched by name."""

from __future__ import annotations

import atexit
import csv
import dataclasses
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from PIL import Image

from dreamstep.data.dataset_config import DatasetConfig, SubsetConfig, load_dataset_config
from dreamstep.data.images import list_images, load_rgb
from dreamstep.data.sources import bucket_spec, dreambooth_from_flags, with_caption_flags
from dreamstep.errors import UserError

# What a Hugging Face image folder names its metadata table.
METADATA_NAMES = ("metadata.jsonl", "metadata.csv")


def edit_pair_datasets(config: Any) -> list[DatasetConfig]:
    """What an edit trainer (flux-kontext-lora, qwen-image-edit-lora, flux2-lora with references) trains on, from its
    config: a dataset TOML (ControlNet-style subsets with ``conditioning_data_dir`` are pairs; DreamBooth or
    fine-tuning subsets train text-to-image), a metadata table (``--dataset_name``) or the folders. Pairs are matched
    by name and share crop and flip (see :mod:`~dreamstep.data.records`), every image checked before a model
    loads."""
    if config.dataset_config is not None:
        datasets = load_dataset_config(config.dataset_config, cli={
            "resolution": config.resolution, "train_batch_size": config.train_batch_size, **config.caption_flags()})
        if len({d.method == "controlnet" for d in datasets}) > 1:
            raise UserError(f"{config.dataset_config}: some datasets have conditioning_data_dir and some do not; "
                            "a run trains edits (conditioning_data_dir in every subset) or text-to-image (in none)")
        return datasets
    common = {"num_repeats": config.repeats, "flip_aug": config.random_flip, "random_crop": not config.center_crop}
    buckets = bucket_spec(config.resolution)
    if config.dataset_name is not None:
        subset = SubsetConfig(where="--dataset_name", metadata_file=_pairs_file(config), caption_extension=None,
                              **common)
        method = "controlnet" if config.cond_image_column else "finetune"
        return [with_caption_flags(DatasetConfig("--dataset_name", method, buckets, config.train_batch_size, (subset,)),
                                   config.caption_flags())]
    dataset = dreambooth_from_flags(
        config.instance_data_dir, config.instance_prompt, caption_extension=config.caption_extension,
        buckets=buckets, center_crop=config.center_crop, random_flip=config.random_flip, repeats=config.repeats,
        batch_size=config.train_batch_size)
    dataset = with_caption_flags(dataset, config.caption_flags())
    if config.conditioning_data_dir is None:
        return [dataset]
    list_images(Path(config.conditioning_data_dir), "--conditioning_data_dir")
    subset = dataclasses.replace(dataset.subsets[0], conditioning_data_dir=Path(config.conditioning_data_dir))
    return [dataclasses.replace(dataset, method="controlnet", subsets=(subset,))]


def _metadata_path(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():
        found = [path / f for f in METADATA_NAMES if (path / f).is_file()]
        if not found:
            raise UserError(f"--dataset_name {name}: no {' or '.join(METADATA_NAMES)} in the folder; add one row "
                            "per pair")
        return found[0]
    if not path.is_file():
        raise UserError(f"--dataset_name {name}: not found; give a metadata file or a folder holding one")
    return path


def _read_rows(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8-sig")
        if path.suffix.lower() == ".csv":
            return list(csv.DictReader(io.StringIO(text)))
        rows = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, csv.Error) as e:
        raise UserError(f"--dataset_name {path}: not a readable {path.suffix} table ({e}); fix the file") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"--dataset_name {path}: expected one object per row")
    return rows


def _cell(row: dict[str, Any], column: str, flag: str, path: Path, number: int) -> Any:
    if row.get(column) in (None, ""):
        raise UserError(f"--dataset_name {path}: row {number} has no '{column}' ({flag}); columns there: "
                        f"{', '.join(row)}")
    return row[column]


def _image_path(cell: Any, table: Path, number: int) -> str:
    """An image named in the table: relative to the table's folder and inside it (as in a Hugging Face image
    folder), or an absolute path, which is taken as given."""
    name = Path(str(cell))
    if name.is_absolute():
        return str(name)
    if os.path.normpath(name).split(os.sep)[0] == os.pardir:  # by the name: a link in the folder is the user's
        raise UserError(f"--dataset_name {table}: row {number}: '{cell}' leads outside the table's folder "
                        f"{table.parent}; name images relative to the table, below its folder (or give an absolute "
                        "path)")
    return str(table.parent / name)


def _pairs_file(config: Any) -> Path:
    """The ``--dataset_name`` table as the metadata JSONL the data package reads (``image``,
    ``conditioning_image``, ``caption``; absolute paths), written to a temporary folder of this process."""
    path = _metadata_path(config.dataset_name)
    table = _read_rows(path)
    if not table:
        raise UserError(f"--dataset_name {path}: the table has no rows; add one row per pair")
    rows = []
    for number, row in enumerate(table, start=1):
        image_column = "file_name" if config.image_column == "image" and "image" not in row else config.image_column
        entry = {"image": _image_path(_cell(row, image_column, "--image_column", path, number), path, number)}
        if config.cond_image_column:
            cond = _cell(row, config.cond_image_column, "--cond_image_column", path, number)
            entry["conditioning_image"] = _image_path(cond, path, number)
        caption = row.get(config.caption_column) if config.caption_column else None
        if config.caption_column and caption is None and config.instance_prompt is None:
            _cell(row, config.caption_column, "--caption_column", path, number)
        entry["caption"] = caption or config.instance_prompt
        if entry["caption"] is None:
            raise UserError(f"--dataset_name {path}: no edit instruction for row {number}; give --caption_column "
                            "or --instance_prompt")
        rows.append(entry)
    folder = Path(tempfile.mkdtemp(prefix="dreamstep-kontext-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    pairs = folder / "metadata.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return pairs


def read_validation_image(path: str | None) -> Image.Image | None:
    """--validation_image read, or ``None``; a missing or unreadable file is one line naming the flag."""
    if path is None:
        return None
    if not Path(path).is_file():
        raise UserError(f"--validation_image {path}: file not found; check the path")
    return load_rgb(Path(path))
