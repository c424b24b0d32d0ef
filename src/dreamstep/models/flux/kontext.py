"""FLUX.1 Kontext plumbing: the "before" image's latent tokens ride beside the target's, as diffusers'
``FluxKontextPipeline`` and ``train_dreambooth_lora_flux_kontext.py`` lay them out.

The transformer sees ``[target tokens | condition tokens]`` along the sequence; the condition tokens carry
the same (row, column) position ids as a target of their size, with the first rotary axis set to 1 instead
of 0, which is all that tells the two images apart. Only the target's tokens are a prediction: the rest of
the output is cut off before the loss (training) or the scheduler step (inference).
"""

from __future__ import annotations

import atexit
import csv
import dataclasses
import functools
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
from PIL import Image

from dreamstep.data.dataset_config import DatasetConfig, SubsetConfig, load_dataset_config
from dreamstep.data.images import list_images, load_rgb
from dreamstep.data.sources import bucket_spec, dreambooth_from_flags, with_caption_flags
from dreamstep.errors import UserError
from dreamstep.models.flux import plumbing as flux

# What a Hugging Face image folder names its metadata table.
METADATA_NAMES = ("metadata.jsonl", "metadata.csv")
# The first rotary axis of an image token: 0 for the image being denoised, 1 for the condition image.
CONDITION_AXIS_VALUE = 1


@functools.lru_cache(maxsize=32)
def condition_image_ids(height: int, width: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Rotary position ids of a packed condition latent of ``height`` x ``width``: (h/2 · w/2, 3), the target's
    ids with the first axis set to :data:`CONDITION_AXIS_VALUE` (``FluxKontextPipeline.prepare_latents``)."""
    ids = FluxKontextPipeline._prepare_latent_image_ids(1, height // 2, width // 2, device, dtype)
    ids[..., 0] = CONDITION_AXIS_VALUE
    return ids


def joined_inputs(inputs: dict[str, Any], condition: torch.Tensor | None) -> dict[str, Any]:
    """The transformer's keyword arguments for a target (``hidden_states`` (B, N, 4C), ``img_ids`` (N, 3), ...) with
    a condition latent (B, C, h', w') beside it: ``hidden_states`` (B, N + N', 4C) and ``img_ids`` (N + N', 3).
    Without a condition (text-to-image Kontext training) the target's alone."""
    if condition is None:
        return inputs
    target, ids = inputs["hidden_states"], inputs["img_ids"]
    condition_ids = condition_image_ids(condition.shape[2], condition.shape[3], ids.device, ids.dtype)
    return {**inputs, "hidden_states": torch.cat([target, flux.pack(condition.to(target.dtype))], dim=1),
            "img_ids": torch.cat([ids, condition_ids], dim=0)}


def target_prediction(prediction: torch.Tensor, num_target_tokens: int) -> torch.Tensor:
    """The prediction of the target's tokens (B, N, 4C) out of the transformer's output (B, N + N', 4C)."""
    return prediction[:, :num_target_tokens]


# ---------------------------------------------------------------- data

def kontext_datasets(config: Any) -> list[DatasetConfig]:
    """What ``train flux-kontext-lora`` trains on, from its config: a dataset TOML (ControlNet-style subsets with
    ``conditioning_data_dir`` are pairs; DreamBooth or fine-tuning subsets train text-to-image), a metadata table
    (``--dataset_name``) or the folders. Pairs are matched by name and share crop and flip (see
    :mod:`~dreamstep.data.records`), every image checked before a model loads."""
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


# ---------------------------------------------------------------- pipeline

def validation_image(path: str | None) -> Image.Image | None:
    """--validation_image read, or ``None``; a missing or unreadable file is one line naming the flag."""
    if path is None:
        return None
    if not Path(path).is_file():
        raise UserError(f"--validation_image {path}: file not found; check the path")
    return load_rgb(Path(path))


def edit_size(image_size: tuple[int, int], keep: bool) -> tuple[int, int]:
    """(width, height) at which ``FluxKontextPipeline`` edits an image of ``image_size``: the Kontext training
    resolution nearest its aspect ratio (what the pipeline resizes it to), or with ``keep`` its own size rounded
    down to the 16 pixels of a latent patch."""
    width, height = image_size
    if keep:
        return max(16, width // 16 * 16), max(16, height // 16 * 16)
    return min(PREFERRED_KONTEXT_RESOLUTIONS, key=lambda size: abs(width / height - size[0] / size[1]))
