"""The dataset check: what a trainer will make of a dataset TOML or an image folder, before training.

Everything comes from that trainer's own data code (:mod:`dreamstep.data`, chosen by
:mod:`~dreamstep.dashboard.trainer_data` from the trainer's config): the TOML parser, the folder
scan and caption rules, image decoding, regularization balancing, bucket selection and the per-epoch
caption processing of :class:`~dreamstep.data.dataset.BucketDataset`. The one difference is that the
trainer stops at the first problem, while the check collects every problem and keeps going.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamstep.dashboard.trainer_data import check_config, folder_flag, trainer_datasets
from dreamstep.data.buckets import BucketPlanner
from dreamstep.data.dataset import BucketDataset
from dreamstep.data.dataset_config import DatasetConfig, SubsetConfig
from dreamstep.data.holdout import split_records
from dreamstep.data.images import ImageInfo, inspect_image, list_images
from dreamstep.data.masks import check_mask, mask_path
from dreamstep.data.records import (
    ImageRecord,
    dataset_repeats,
    folder_caption,
    rebalance_regularization,
    subset_entries,
)
from dreamstep.errors import UserError

__all__ = ["CheckedImage", "DatasetCheck", "check_dataset", "check_datasets", "check_trainer_data", "summary"]


@dataclass
class CheckedImage:
    """One image as the trainer sees it; ``record`` is ``None`` when a problem keeps it out of training."""

    path: Path
    subset: int  # index into DatasetCheck.subsets
    caption: str | None
    repeats: int
    size: tuple[int, int] | None = None
    bucket: tuple[int, int] | None = None
    resized: tuple[int, int] | None = None
    problems: list[str] = field(default_factory=list)
    record: ImageRecord | None = None
    mask: Path | None = None  # the file --masked_loss reads its mask from (the image itself for alpha masks)
    held_out: bool = False  # held out for the validation loss (--validation_split or a validation subset)

    @property
    def upscaled(self) -> bool:
        return self.size is not None and self.resized is not None and self.resized[0] > self.size[0]


@dataclass
class DatasetCheck:
    """Every image of every dataset, the problems found, and the trainer's dataset built from the good ones."""

    source: str
    configs: list[DatasetConfig]
    subsets: list[tuple[int, SubsetConfig]]  # (dataset index, subset)
    images: list[CheckedImage]
    problems: list[str]
    dataset: BucketDataset | None
    seed: int

    def captions(self, epoch: int) -> dict[int, str]:
        """Image index -> the caption of its first sample in ``epoch``, as training will see it."""
        if self.dataset is None:
            return {}
        first_sample: dict[int, int] = {}
        for sample, record_index in enumerate(self.dataset.samples):
            first_sample.setdefault(record_index, sample)
        by_record = {id(image.record): i for i, image in enumerate(self.images) if image.record is not None}
        out = {}
        for record_index, sample in first_sample.items():
            caption, _ = self.dataset.caption(sample, epoch)
            out[by_record[id(self.dataset.records[record_index])]] = caption
        return out


def check_dataset(source: str | Path | None = None, resolution: int | None = None, seed: int | None = None,
                  instance_prompt: str | None = None, *, trainer: str = "flux-lora",
                  config_toml: str | Path | None = None) -> DatasetCheck:
    """Check ``source`` (a dataset TOML or an image folder; ``None``: the data of ``config_toml``) as
    ``dreamstep train TRAINER --config CONFIG_TOML`` reads it (:func:`~dreamstep.dashboard.trainer_data.check_config`),
    with ``resolution``, ``seed`` and ``instance_prompt`` as flags where given. A TOML or flag error raises
    UserError."""
    config = check_config(trainer, source, config_toml, resolution=resolution, seed=seed,
                          instance_prompt=instance_prompt)
    return check_trainer_data(trainer, config, str(source) if source is not None else None)


def check_trainer_data(trainer: str, config: Any, source: str | None = None,
                       roots: list[Path] | None = None) -> DatasetCheck:
    """Check the data of ``config`` (the config dataclass of ``train TRAINER``) with that trainer's data code;
    ``source`` names it on the page (default: its dataset TOML or image folder). With ``roots`` (the folders a
    server may read) every folder and image the data names, however it is reached (a dataset TOML, a metadata
    table, a symlink), must lie inside one of them; it is refused before any image is read."""
    configs = trainer_datasets(trainer, config)
    if source is None:
        source = str(config.dataset_config or getattr(config, folder_flag(trainer), None) or configs[0].where)
    return check_datasets(configs, source, config.seed, roots, getattr(config, "validation_split", 0.0))


def check_datasets(configs: list[DatasetConfig], source: str, seed: int, roots: list[Path] | None = None,
                   validation_split: float = 0.0) -> DatasetCheck:
    """Check every image of the trainer's ``configs`` (what :func:`trainer_datasets` gives); ``roots``: see
    :func:`check_trainer_data`. The images the run holds out for its validation loss (``validation_split``,
    validation subsets) are drawn as the trainer draws them (:func:`~dreamstep.data.holdout.split_records`) and
    left out of the epoch."""
    subsets: list[tuple[int, SubsetConfig]] = []
    images: list[CheckedImage] = []
    problems: list[str] = []
    groups = []
    for d, config in enumerate(configs):
        first = len(subsets)
        entries = []
        for subset in config.subsets:
            subsets.append((d, subset))
            if roots is not None:
                _refuse_outside(roots, subset.where, subset.image_dir, subset.conditioning_data_dir,
                                subset.metadata_file)
            found, subset_problems = _entries(subset, config.method)
            if roots is not None:
                for path, _, _, conditioning in found:
                    _refuse_outside(roots, subset.where, path, conditioning)
            problems += subset_problems
            entries.append((subset, found))
        checked = [CheckedImage(path, first + s, caption, count, problems=[problem] if problem else [],
                                mask=_mask_file(path, conditioning, subset))
                   for s, ((subset, found), counts) in enumerate(zip(entries, dataset_repeats(config, entries)))
                   for (path, caption, problem, conditioning), count in zip(found, counts)]
        _inspect_all(checked, BucketPlanner(config.buckets), subsets)
        records = [i.record for i in checked if i.record is not None]
        try:
            training, held = split_records(records, validation_split, seed)
        except UserError as error:
            problems.append(str(error))
            training, held = records, []
        if held and not config.prior_pairs:
            training = rebalance_regularization(training)
        _take_split(checked, training, held)
        groups.append((training, config.batch_size, config.prior_pairs))
        images += checked
    problems += [f"{i.path}: {p}" for i in images for p in i.problems]
    dataset = BucketDataset(groups, seed) if any(records for records, *_ in groups) else None
    return DatasetCheck(source, configs, subsets, images, problems, dataset, seed)


def _take_split(checked: list[CheckedImage], training: list[ImageRecord], held: list[ImageRecord]) -> None:
    """Mark the held-out images, and give the others the records (and repeats) the epoch is made of."""
    held_ids = {id(r) for r in held}
    by_path = {r.image.path: r for r in training}
    for image in checked:
        if image.record is None:
            continue
        if id(image.record) in held_ids:
            image.held_out = True
            continue
        image.record = by_path.get(image.record.image.path)
        image.repeats = image.record.num_repeats if image.record is not None else 0


def _refuse_outside(roots: list[Path], where: str, *paths: Path | None) -> None:
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    for path in paths:
        real = Path(os.path.realpath(path)) if path is not None else None
        if real is not None and not any(real == root or root in real.parents for root in real_roots):
            raise UserError(f"{where}: {path} lies outside the folders this dashboard serves"
                            f"{' (through a symlink)' if real != Path(os.path.abspath(path)) else ''}; refused")


def _mask_file(image: Path, conditioning: Path | None, subset: SubsetConfig) -> Path | None:
    return mask_path(image, conditioning, subset.mask_source) if subset.mask_source is not None else None


def _entries(subset: SubsetConfig, method: str) -> tuple[list[tuple[Path, str | None, str | None, Path | None]],
                                                         list[str]]:
    """(image, caption, problem, conditioning image) for each image of a subset, with the trainer's rules; where
    the trainer would stop at the first missing caption, go on image by image."""
    try:
        return [(e.path, e.caption, None, e.conditioning) for e in subset_entries(subset, method)], []
    except UserError as e:
        if subset.image_dir is None or subset.metadata_file is not None or subset.conditioning_data_dir:
            return [], [str(e)]
    try:
        paths = list_images(subset.image_dir, subset.where)
    except UserError as e:
        return [], [str(e)]
    found: list[tuple[Path, str | None, str | None, Path | None]] = []
    for path in paths:
        try:
            found.append((path, folder_caption(path, subset), None, None))
        except UserError as e:
            found.append((path, None, f"missing caption: {str(e).split(': ', 1)[-1]}", None))
    return found, []


def _inspect_all(images: list[CheckedImage], planner: BucketPlanner,
                 subsets: list[tuple[int, SubsetConfig]]) -> None:
    """Decode every image (as the trainer does before training), choose its bucket, and make the
    trainer's record for each image without problems (an upscaled image still trains)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        infos = list(pool.map(_inspected, [i.path for i in images]))
    for image, info in zip(images, infos):
        if not isinstance(info, ImageInfo):
            image.problems.append(f"unreadable: {info}")
            continue
        image.size = info.size
        image.bucket, image.resized = planner.select(*info.size)
        if min(image.bucket) <= 0:
            image.problems.append(f"{info.size[0]}x{info.size[1]} is smaller than bucket_reso_steps")
            continue
        if image.upscaled:
            image.problems.append(f"will be upscaled from {info.size[0]}x{info.size[1]} to "
                                  f"{image.resized[0]}x{image.resized[1]} for bucket "
                                  f"{image.bucket[0]}x{image.bucket[1]}")
        subset = subsets[image.subset][1]
        if image.mask is not None:
            try:
                check_mask(image.mask, subset.mask_source)
            except UserError as e:
                image.problems.append(f"mask: {str(e).split(': ', 1)[-1]}")
                continue
        if image.caption is not None and image.repeats > 0:
            image.record = ImageRecord(info, image.caption, subsets[image.subset][1], None, image.repeats,
                                       image.bucket, image.resized)


_INSPECTED: dict[tuple[Path, int, int], ImageInfo | str] = {}  # (path, size, mtime) -> what decoding it gave
_INSPECTED_MAX = 200_000


def _inspected(path: Path) -> ImageInfo | str:
    """:func:`~dreamstep.data.images.inspect_image`, remembered while the file is unchanged: the new-run form checks
    the data again at every change of an option, and a large folder is decoded once."""
    try:
        stat = path.stat()
    except OSError:
        return inspect_image(path)
    key = (path, stat.st_size, stat.st_mtime_ns)
    found = _INSPECTED.get(key)
    if found is None:
        found = _INSPECTED[key] = inspect_image(path)
        if len(_INSPECTED) > _INSPECTED_MAX:
            _INSPECTED.clear()
    return found


def summary(check: DatasetCheck, epoch: int) -> dict[str, Any]:
    """The check as JSON for the page: datasets, subsets, buckets with counts, images, problems."""
    captions = check.captions(epoch)
    subsets = []
    for index, (d, subset) in enumerate(check.subsets):
        members = [i for i in check.images if i.subset == index and not i.held_out]
        subsets.append({"where": subset.where, "dataset": d, "is_reg": subset.is_reg,
                        "num_repeats": subset.num_repeats, "images": len(members),
                        "used": sum(1 for i in members if i.record is not None),
                        "samples": sum(i.repeats for i in members if i.record is not None),
                        "shuffle_caption": subset.captions.shuffle_caption, "keep_tokens": subset.captions.keep_tokens})
    datasets = []
    for d, config in enumerate(check.configs):
        buckets: dict[tuple[int, int], list[int]] = {}
        for n, image in enumerate(check.images):
            if (check.subsets[image.subset][0] == d and image.bucket is not None and image.record is not None
                    and not image.held_out):
                buckets.setdefault(image.bucket, []).append(n)
        datasets.append({
            "where": config.where, "method": config.method, "batch_size": config.batch_size,
            "resolution": list(config.buckets.resolution), "enable_bucket": config.buckets.enable_bucket,
            "buckets": [{"size": list(size), "images": members,
                         "samples": sum(check.images[n].repeats for n in members)}
                        for size, members in sorted(buckets.items())]})
    images = [{"name": i.path.name, "path": str(i.path), "subset": i.subset,
               "is_reg": check.subsets[i.subset][1].is_reg,
               "raw_caption": i.caption, "caption": captions.get(n), "repeats": i.repeats,
               "size": list(i.size) if i.size else None, "bucket": list(i.bucket) if i.bucket else None,
               "problems": i.problems, "used": i.record is not None and not i.held_out, "held_out": i.held_out,
               "mask": i.mask is not None}
              for n, i in enumerate(check.images)]
    return {"source": check.source, "epoch": epoch, "seed": check.seed, "datasets": datasets, "subsets": subsets,
            "images": images, "problems": check.problems}
