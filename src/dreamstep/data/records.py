"""From a :class:`DatasetConfig` to the list of images it trains on: folders are scanned, captions read
(caption files, ``class_tokens``, or a JSON/JSONL metadata file), ControlNet partners matched, every
image decoded once, regularization repeats balanced as sd-scripts does (unless the dataset pairs class
samples with instance samples, diffusers' way: see :class:`~dreamstep.data.dataset.BucketBatchSampler`),
and each image given its bucket.
Every problem is found here, before training, and reported by file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamstep.data.buckets import BucketPlanner, Size
from dreamstep.data.dataset_config import DatasetConfig, SubsetConfig
from dreamstep.data.images import IMAGE_EXTENSIONS, ImageInfo, list_images, skipped_files, validate_images
from dreamstep.data.masks import check_mask, mask_path
from dreamstep.errors import UserError

log = logging.getLogger(__name__)
_IMAGE_COLUMNS = ("image", "file_name", "image_path", "path")
_CAPTION_COLUMNS = ("caption", "text")
_CONDITIONING_COLUMNS = ("conditioning_image", "conditioning_file_name")


@dataclass(frozen=True)
class _Entry:
    """An image before validation: its path, caption and optional ControlNet partner."""

    path: Path
    caption: str
    conditioning: Path | None


@dataclass(frozen=True)
class ImageRecord:
    """One validated training image with everything needed to turn it into samples."""

    image: ImageInfo
    caption: str  # before per-epoch processing (prefix, shuffle, dropout)
    subset: SubsetConfig
    conditioning: ImageInfo | None
    num_repeats: int
    bucket: Size
    resized: Size


def collect_records(config: DatasetConfig) -> list[ImageRecord]:
    """All images of one dataset, validated, balanced and bucketed."""
    if config.subsets and all(subset.is_reg for subset in config.subsets):
        raise UserError(f"{config.where}: every subset has is_reg = true, so there are only regularization "
                        "images and nothing to learn; add a subset of training images (is_reg = false)")
    entries = [(subset, subset_entries(subset, config.method)) for subset in config.subsets]
    paths = [e.path for _, es in entries for e in es] + [e.conditioning for _, es in entries for e in es
                                                          if e.conditioning is not None]
    infos = validate_images(list(dict.fromkeys(paths)))
    repeats = dataset_repeats(config, entries)
    planner = BucketPlanner(config.buckets)
    records = []
    for (subset, found), subset_repeats in zip(entries, repeats):
        for entry, count in zip(found, subset_repeats):
            if count == 0:
                continue
            image = infos[entry.path]
            conditioning = infos[entry.conditioning] if entry.conditioning is not None else None
            if conditioning is not None:
                _check_partner(image, conditioning)
            if subset.mask_source is not None:
                check_mask(mask_path(image.path, entry.conditioning, subset.mask_source), subset.mask_source)
            bucket, resized = planner.select(*image.size)
            if min(bucket) <= 0:
                raise UserError(f"{image.path}: image {image.size[0]}x{image.size[1]} is smaller than "
                                f"bucket_reso_steps ({config.buckets.bucket_reso_steps}); enlarge or remove it")
            records.append(ImageRecord(image, entry.caption, subset, conditioning, count, bucket, resized))
    return records


def skipped_in(config: DatasetConfig) -> list[tuple[Path, str]]:
    """Every file in the dataset's image folders that training leaves out, with the reason."""
    skipped = []
    for subset in config.subsets:
        companions = (subset.caption_extension,) if subset.caption_extension else ()
        for folder in (subset.image_dir, subset.conditioning_data_dir):
            if folder is not None and Path(folder).is_dir():
                skipped += skipped_files(Path(folder), companions)
    return skipped


def balance_regularization(num_train_images: int, reg_repeats: list[int]) -> list[int]:
    """sd-scripts' balancing: register regularization images in order (each with its own repeats) until
    they supply ``num_train_images`` samples; if one pass is not enough, add one repeat per image, round
    robin, until they do. Returns each image's repeats; 0 means it is left out."""
    result = [0] * len(reg_repeats)
    if not reg_repeats:
        return result
    supplied, first_pass = 0, True
    while supplied < num_train_images:
        for i, repeats in enumerate(reg_repeats):
            if first_pass:
                result[i] = repeats
                supplied += repeats
            else:
                result[i] += 1
                supplied += 1
            if supplied >= num_train_images:
                break
        first_pass = False
    return result


def rebalance_regularization(records: list[ImageRecord]) -> list[ImageRecord]:
    """``records`` with the regularization images balanced again, against the training samples that remain
    once held-out images are taken out (sd-scripts balances to the images it trains on)."""
    reg = [r for r in records if r.subset.is_reg]
    num_train = sum(r.num_repeats for r in records if not r.subset.is_reg and not r.subset.is_validation)
    counts = dict(zip(map(id, reg), balance_regularization(num_train, [r.subset.num_repeats for r in reg])))
    return [dataclasses.replace(r, num_repeats=counts[id(r)]) if r.subset.is_reg else r for r in records
            if not r.subset.is_reg or counts[id(r)] > 0]


def dataset_repeats(config: DatasetConfig, entries: list[tuple[SubsetConfig, list[Any]]]) -> list[list[int]]:
    """Each entry's repeats per epoch: sd-scripts' regularization balancing, or, for a dataset that pairs
    class samples with instance samples (diffusers' prior preservation), every subset's own ``num_repeats``
    (the batch sampler cycles the shorter side)."""
    if config.prior_pairs:
        return [[s.num_repeats] * len(es) for s, es in entries]
    return balanced_repeats(entries)


def balanced_repeats(entries: list[tuple[SubsetConfig, list[Any]]]) -> list[list[int]]:
    """Each entry's repeats per epoch: its subset's ``num_repeats``, regularization balanced."""
    num_train = sum(s.num_repeats * len(es) for s, es in entries if not s.is_reg and not s.is_validation)
    reg_slots = [(i, j) for i, (s, es) in enumerate(entries) if s.is_reg for j in range(len(es))]
    repeats = [[s.num_repeats] * len(es) for s, es in entries]
    balanced = balance_regularization(num_train, [entries[i][0].num_repeats for i, _ in reg_slots])
    for (i, j), count in zip(reg_slots, balanced):
        repeats[i][j] = count
    if reg_slots:
        used = sum(1 for c in balanced if c > 0)
        log.info("regularization: %d of %d images used, %d samples per epoch against %d training samples",
                 used, len(reg_slots), sum(balanced), num_train)
    return repeats


def subset_entries(subset: SubsetConfig, method: str) -> list[_Entry]:
    """A subset's images with their captions (and ControlNet partners), before the images are decoded."""
    if subset.metadata_file is not None:
        entries = _metadata_entries(subset)
    else:
        assert subset.image_dir is not None
        entries = [_Entry(p, folder_caption(p, subset), None) for p in list_images(subset.image_dir, subset.where)]
    if subset.conditioning_data_dir is not None:
        entries = _pair_with_conditioning(entries, subset)
    if method == "controlnet":
        missing = [e.path for e in entries if e.conditioning is None]
        if missing:
            raise UserError(f"{subset.where}: {missing[0]} has no conditioning image; give conditioning_data_dir "
                            "or a conditioning_image column")
    return entries


def folder_caption(image: Path, subset: SubsetConfig) -> str:
    """The caption file's first line, else ``class_tokens``; with neither the caption file is required."""
    if subset.caption_extension:
        caption_path = image.with_suffix(subset.caption_extension)
        if caption_path.is_file():
            return _read_caption_file(caption_path)
        if subset.class_tokens is None:
            raise UserError(f"{caption_path}: caption file not found for {image.name}; write it, or set "
                            f"{subset.caption_fallback} for {subset.where}")
    if subset.class_tokens is None:
        raise UserError(f"{subset.where}: no captions: set caption_extension or class_tokens")
    return subset.class_tokens


def _read_caption_file(path: Path) -> str:
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the caption.
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{path}: caption file is not UTF-8 text; re-save it as UTF-8") from None
    if not lines or not lines[0].strip():
        raise UserError(f"{path}: caption file is empty (the first line is the caption); write a caption")
    return lines[0].strip()


def _pair_with_conditioning(entries: list[_Entry], subset: SubsetConfig) -> list[_Entry]:
    """Match each image to the conditioning image with the same name stem; unmatched files either way
    are errors (as in sd-scripts), so no pair is silently dropped."""
    folder = subset.conditioning_data_dir
    by_stem: dict[str, Path] = {}
    for path in list_images(folder, f"{subset.where}: conditioning_data_dir"):
        if path.stem in by_stem:
            raise UserError(f"{path}: two conditioning images named '{path.stem}' ({by_stem[path.stem].name}); "
                            "keep one")
        by_stem[path.stem] = path
    paired = []
    for entry in entries:
        partner = by_stem.pop(entry.path.stem, None)
        if partner is None:
            raise UserError(f"{entry.path}: no conditioning image named '{entry.path.stem}.*' in {folder}; "
                            "add it or remove the image")
        paired.append(_Entry(entry.path, entry.caption, partner))
    if by_stem:
        extra = sorted(by_stem.values())[0]
        raise UserError(f"{extra}: conditioning image has no training image of the same name in "
                        f"{subset.image_dir}; add the image or remove it")
    return paired


# The smallest side either image of a pair may have: one FLUX latent patch (2x2 latents of 8 pixels).
MIN_CONDITIONING_SIDE = 16


def _check_partner(image: ImageInfo, conditioning: ImageInfo) -> None:
    (w, h), (cw, ch) = image.size, conditioning.size
    if min(cw, ch) < MIN_CONDITIONING_SIDE:
        raise UserError(f"{conditioning.path}: conditioning image is {cw}x{ch}, smaller than "
                        f"{MIN_CONDITIONING_SIDE} pixels a side, so it holds nothing to condition on; give the full "
                        "image of the pair")
    if min(w, h) < MIN_CONDITIONING_SIDE:
        raise UserError(f"{image.path}: image is {w}x{h}, smaller than {MIN_CONDITIONING_SIDE} pixels a side, so "
                        f"it shows nothing the pair with {conditioning.path.name} could teach; give the full image")
    if conditioning.sha256 == image.sha256:
        log.warning("%s: the same image as %s, its pair; the pair teaches no change (an edit or a control)",
                    conditioning.path, image.path.name)
    if abs(w / h - cw / ch) > 0.01 * (w / h):
        raise UserError(f"{conditioning.path}: conditioning image is {cw}x{ch} but {image.path.name} is {w}x{h}; "
                        "a pair must have the same aspect ratio")


def _metadata_entries(subset: SubsetConfig) -> list[_Entry]:
    path = subset.metadata_file
    assert path is not None
    rows = _read_metadata(path)
    entries = []
    for key, row in rows:
        where = f"{path}: entry '{key}'"
        image = _resolve_image(key, subset, path, where)
        conditioning_key = _first(row, _CONDITIONING_COLUMNS)
        conditioning = (_resolve_image(str(conditioning_key), subset, path, f"{where}: conditioning image")
                        if conditioning_key is not None else None)
        entries.append(_Entry(image, _metadata_caption(row, where), conditioning))
    if not entries:
        raise UserError(f"{path}: metadata file has no entries; add captions for the images")
    return entries


def _read_metadata(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Kohya JSON (``{image_key: {"caption": ..., "tags": ...}}``), a JSON list, or JSONL rows that name
    their image in an ``image``/``file_name`` column."""
    if not path.is_file():
        raise UserError(f"{path}: metadata file not found; check metadata_file")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; save the metadata file as UTF-8") from None
    try:
        if path.suffix.lower() == ".jsonl":
            rows: Any = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON at line {e.lineno} ({e.msg}); fix the file") from None
    if isinstance(rows, dict):
        return [(str(k), _row(v, path, str(k))) for k, v in rows.items()]
    if not isinstance(rows, list):
        raise UserError(f"{path}: expected an object or a list of rows")
    result = []
    for n, row in enumerate(rows):
        row = _row(row, path, f"row {n + 1}")
        key = _first(row, _IMAGE_COLUMNS)
        if key is None:
            raise UserError(f"{path}: row {n + 1} names no image; add an 'image' or 'file_name' column")
        result.append((str(key), row))
    return result


def _row(value: Any, path: Path, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{path}: entry '{key}' must be an object with a caption")
    return value


def _first(row: dict[str, Any], columns: tuple[str, ...]) -> Any:
    return next((row[c] for c in columns if row.get(c) is not None), None)


def _metadata_caption(row: dict[str, Any], where: str) -> str:
    """sd-scripts: the caption's first line, then ``, tags``; tags alone when there is no caption."""
    caption, tags = _first(row, _CAPTION_COLUMNS), row.get("tags")
    if caption is None:
        caption, tags = tags, None
    caption = str(caption).split("\n")[0].strip() if caption is not None else ""
    if tags:
        caption = f"{caption}, {tags}" if caption else str(tags)
    if not caption:
        raise UserError(f"{where}: no caption or tags; add a 'caption' (or 'text') value")
    return caption


def _resolve_image(key: str, subset: SubsetConfig, metadata: Path, where: str) -> Path:
    """Find an image named in a metadata file: as given, under image_dir, or beside the metadata file;
    a key without an extension matches any image extension (as sd-scripts' Kohya JSON keys do)."""
    candidates = [Path(key)]
    for base in (subset.image_dir, metadata.parent):
        if base is not None and not Path(key).is_absolute():
            candidates.append(Path(base) / key)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
        for ext in IMAGE_EXTENSIONS:
            for variant in (ext, ext.upper()):
                with_ext = candidate.with_name(candidate.name + variant)
                if with_ext.is_file():
                    return with_ext
    places = " or ".join(str(c) for c in dict.fromkeys(candidates))
    raise UserError(f"{where}: image not found (looked for {places}); fix the entry or image_dir")
