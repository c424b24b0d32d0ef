"""The dataset check: what the trainer will make of a dataset TOML or an image folder, before training.

Everything comes from the trainer's own data code (:mod:`dreamstep.data`): the TOML parser, the folder
scan and caption rules, image decoding, regularization balancing, bucket selection and the per-epoch
caption processing of :class:`~dreamstep.data.dataset.BucketDataset`. The one difference is that the
trainer stops at the first problem, while the check collects every problem and keeps going.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamstep.config.flux_lora import FluxLoraConfig
from dreamstep.data.buckets import BucketPlanner
from dreamstep.data.dataset import BucketDataset
from dreamstep.data.dataset_config import DatasetConfig, SubsetConfig
from dreamstep.data.images import ImageInfo, inspect_image, list_images
from dreamstep.data.records import ImageRecord, dataset_repeats, folder_caption, subset_entries
from dreamstep.data.sources import flux_lora_datasets
from dreamstep.errors import UserError

__all__ = ["CheckedImage", "DatasetCheck", "check_dataset", "load_configs"]



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


def load_configs(source: str | Path, resolution: int, instance_prompt: str | None = None) -> list[DatasetConfig]:
    """A Kohya dataset TOML or an image folder, read as ``train flux-lora --dataset_config TOML`` or
    ``--instance_data_dir FOLDER --instance_prompt ...`` reads it, with that trainer's defaults (its code
    does the reading), at ``resolution``."""
    path = Path(source)
    if not path.exists():
        raise UserError(f"--dataset {path}: no such file or folder; give a dataset TOML or an image folder")
    given = {"dataset_config": str(path)} if path.is_file() else {"instance_data_dir": str(path),
                                                                  "instance_prompt": instance_prompt}
    config = FluxLoraConfig(pretrained_model_name_or_path=".", output_dir=".", resolution=resolution, **given)
    return flux_lora_datasets(config, None)


def check_dataset(source: str | Path, resolution: int = 1024, seed: int = 0,
                  instance_prompt: str | None = None) -> DatasetCheck:
    """Check every image of ``source`` (see :func:`load_configs`); a TOML error raises UserError."""
    configs = load_configs(source, resolution, instance_prompt)
    subsets: list[tuple[int, SubsetConfig]] = []
    images: list[CheckedImage] = []
    problems: list[str] = []
    groups = []
    for d, config in enumerate(configs):
        first = len(subsets)
        entries = []
        for subset in config.subsets:
            subsets.append((d, subset))
            found, subset_problems = _entries(subset, config.method)
            problems += subset_problems
            entries.append((subset, found))
        checked = [CheckedImage(path, first + s, caption, count, problems=[problem] if problem else [])
                   for s, ((_, found), counts) in enumerate(zip(entries, dataset_repeats(config, entries)))
                   for (path, caption, problem), count in zip(found, counts)]
        _inspect_all(checked, BucketPlanner(config.buckets), subsets)
        groups.append(([i.record for i in checked if i.record is not None], config.batch_size,
                       config.prior_pairs))
        images += checked
    problems += [f"{i.path}: {p}" for i in images for p in i.problems]
    dataset = BucketDataset(groups, seed) if any(records for records, *_ in groups) else None
    return DatasetCheck(str(source), configs, subsets, images, problems, dataset, seed)


def _entries(subset: SubsetConfig, method: str) -> tuple[list[tuple[Path, str | None, str | None]], list[str]]:
    """(image, caption, problem) for each image of a subset, with the trainer's rules; where the trainer
    would stop at the first missing caption, go on image by image."""
    try:
        return [(e.path, e.caption, None) for e in subset_entries(subset, method)], []
    except UserError as e:
        if subset.image_dir is None or subset.metadata_file is not None or subset.conditioning_data_dir:
            return [], [str(e)]
    try:
        paths = list_images(subset.image_dir, subset.where)
    except UserError as e:
        return [], [str(e)]
    found: list[tuple[Path, str | None, str | None]] = []
    for path in paths:
        try:
            found.append((path, folder_caption(path, subset), None))
        except UserError as e:
            found.append((path, None, f"missing caption: {str(e).split(': ', 1)[-1]}"))
    return found, []


def _inspect_all(images: list[CheckedImage], planner: BucketPlanner,
                 subsets: list[tuple[int, SubsetConfig]]) -> None:
    """Decode every image (as the trainer does before training), choose its bucket, and make the
    trainer's record for each image without problems (an upscaled image still trains)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        infos = list(pool.map(inspect_image, [i.path for i in images]))
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
        if image.caption is not None and image.repeats > 0:
            image.record = ImageRecord(info, image.caption, subsets[image.subset][1], None, image.repeats,
                                       image.bucket, image.resized)


def summary(check: DatasetCheck, epoch: int) -> dict[str, Any]:
    """The check as JSON for the page: datasets, subsets, buckets with counts, images, problems."""
    captions = check.captions(epoch)
    subsets = []
    for index, (d, subset) in enumerate(check.subsets):
        members = [i for i in check.images if i.subset == index]
        subsets.append({"where": subset.where, "dataset": d, "is_reg": subset.is_reg,
                        "num_repeats": subset.num_repeats, "images": len(members),
                        "used": sum(1 for i in members if i.record is not None),
                        "samples": sum(i.repeats for i in members if i.record is not None),
                        "shuffle_caption": subset.captions.shuffle_caption, "keep_tokens": subset.captions.keep_tokens})
    datasets = []
    for d, config in enumerate(check.configs):
        buckets: dict[tuple[int, int], list[int]] = {}
        for n, image in enumerate(check.images):
            if check.subsets[image.subset][0] == d and image.bucket is not None and image.record is not None:
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
               "problems": i.problems, "used": i.record is not None}
              for n, i in enumerate(check.images)]
    return {"source": check.source, "epoch": epoch, "seed": check.seed, "datasets": datasets, "subsets": subsets,
            "images": images, "problems": check.problems}
