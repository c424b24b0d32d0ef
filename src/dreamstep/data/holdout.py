"""Held-out images for the validation loss: a subset marked ``is_validation = true`` in a dataset TOML
(or given as a validation folder), and/or a fixed fraction of the training images (``--validation_split``).

The fraction is drawn by content: images are ordered by a hash of (seed, image bytes' sha256), so the
same data and seed hold out the same images in every run and on every process, whatever the file order.
Regularization (class) images are never held out; held-out images are never trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path

from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset, build_dataset
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.data.records import ImageRecord, collect_records, rebalance_regularization
from dreamstep.errors import UserError


def _order_key(record: ImageRecord, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{record.image.sha256}".encode()).hexdigest()


def split_records(records: list[ImageRecord], fraction: float, seed: int
                  ) -> tuple[list[ImageRecord], list[ImageRecord]]:
    """(training records, held-out records): the validation subsets' records, plus ``fraction`` of the other
    non-regularization records (at least one when ``fraction`` > 0, and never all of them)."""
    held = [r for r in records if r.subset.is_validation]
    candidates = [r for r in records if not r.subset.is_validation and not r.subset.is_reg]
    if fraction > 0:
        count = max(1, round(fraction * len(candidates)))
        if count >= len(candidates):
            raise UserError(f"--validation_split {fraction} would hold out all {len(candidates)} training images; "
                            "use a smaller fraction, more images, or a validation folder")
        held += sorted(candidates, key=lambda r: _order_key(r, seed))[:count]
    held_ids = {id(r) for r in held}
    return [r for r in records if id(r) not in held_ids], held


def build_split_datasets(configs: Sequence[DatasetConfig], seed: int, validation_split: float = 0.0, *,
                         latent_cache: TensorCache | None = None, text_cache: TensorCache | None = None
                         ) -> tuple[BucketDataset, BucketDataset | None]:
    """The training dataset and the held-out one (``None`` without held-out images), both reading the caches
    given; each held-out image appears once, whatever its ``num_repeats``. The training dataset's ``skipped``
    lists the files in the image folders that are not trained on, with the reason, and its ``held_out`` the
    images held out."""
    training, held_out = [], []
    for config in configs:
        train_records, held = split_records(collect_records(config), validation_split, seed)
        if held and not config.prior_pairs:
            train_records = rebalance_regularization(train_records)
        if not train_records:
            raise UserError(f"{config.where}: every image is held out for validation; keep some to train on")
        training.append(train_records)
        if held:
            held_out.append(([dataclasses.replace(r, num_repeats=1) for r in held], config.batch_size, False))
    dataset = build_dataset(configs, seed, latent_cache, records=training, text_cache=text_cache)
    dataset.held_out = [r.image.path for records, _, _ in held_out for r in records]
    return dataset, BucketDataset(held_out, seed, latent_cache, text_cache) if held_out else None


def subject_image_paths(dataset: BucketDataset, held_out: BucketDataset | None) -> list[Path]:
    """The subject's real images (DINO / CLIP-I references): every non-regularization image, held out or not."""
    records = dataset.records + (held_out.records if held_out is not None else [])
    return list(dict.fromkeys(r.image.path for r in records if not r.subset.is_reg))

