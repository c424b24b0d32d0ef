"""The torch side: a map-style dataset of bucketed samples, a batch sampler that keeps each batch inside
one bucket, and the collate function.

Every random choice for a sample (crop, flip, caption shuffle and dropout) comes from a generator seeded
with (seed, epoch, sample index), and the batch order from one seeded with (seed, epoch). So an epoch is
the same in every run, in every worker process, and a resumed run that skips the first k batches sees
exactly the batches the interrupted run would have seen next.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from dreamstep.data.buckets import Placement, place
from dreamstep.data.cache import TensorCache, image_content_key, stack_entries, text_content_key
from dreamstep.data.captions import process_caption
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.data.images import load_rgb
from dreamstep.data.masks import mask_path, read_mask
from dreamstep.data.records import ImageRecord, collect_records, skipped_in
from dreamstep.errors import UserError

SampleKey = tuple[int, int]  # (sample index, epoch)
_BATCH_ORDER_STREAM = 1  # keeps the batch-order generator apart from the per-sample ones


class BucketDataset(Dataset):
    """Samples of one or more datasets; each image appears ``num_repeats`` times.

    Index with ``(index, epoch)`` (what :class:`BucketBatchSampler` yields) or a bare index (epoch 0). With a
    ``latent_cache``, a sample whose latents are cached comes with ``latents`` instead of ``pixel_values``;
    with a ``text_cache``, with its caption's cached text-encoder outputs as ``text`` (None when not cached).
    Cache entries are so read where the samples are, in the loader's workers when it has some.
    """

    def __init__(self, groups: Sequence[tuple[list[ImageRecord], int, bool]], seed: int,
                 latent_cache: TensorCache | None = None, text_cache: TensorCache | None = None):
        self.records: list[ImageRecord] = []
        self.samples: list[int] = []  # sample index -> record index
        self.sample_group: list[tuple[int, int, int]] = []  # (dataset, bucket w, bucket h)
        self.batch_sizes: list[int] = []
        self.prior_pairs: list[bool] = []  # per dataset: batches pair instance and class samples
        for group_index, (records, batch_size, prior_pairs) in enumerate(groups):
            self.batch_sizes.append(batch_size)
            self.prior_pairs.append(prior_pairs)
            for record in records:
                self.records.append(record)
                for _ in range(record.num_repeats):
                    self.samples.append(len(self.records) - 1)
                    self.sample_group.append((group_index, *record.bucket))
        if not self.samples:
            raise UserError("the dataset has no images; check the image folders")
        self.seed = seed
        self.latent_cache = latent_cache
        self.text_cache = text_cache
        self.skipped: list[tuple[Path, str]] = []  # files in the image folders not trained on, and why
        self.held_out: list[Path] = []  # images of the folders held out for the validation loss

    def __len__(self) -> int:
        return len(self.samples)

    def placement(self, index: int, epoch: int) -> tuple[Placement, np.random.Generator]:
        """The crop and flip of sample ``index`` in ``epoch``, and the generator, ready for the caption."""
        record = self.records[self.samples[index]]
        rng = np.random.default_rng([self.seed, epoch, index])
        flip = bool(record.subset.flip_aug and rng.random() < 0.5)
        return place(record.bucket, record.resized, record.subset.random_crop, flip, rng), rng

    def caption(self, index: int, epoch: int) -> tuple[str, Placement]:
        """The caption sample ``index`` is trained with in ``epoch`` (shuffle, keep_tokens and dropout
        applied), and its placement: exactly what :meth:`__getitem__` uses, without decoding the image."""
        record = self.records[self.samples[index]]
        placement, rng = self.placement(index, epoch)
        return process_caption(record.caption, record.subset.captions, epoch, rng), placement

    def caption_and_keys(self, index: int, epoch: int) -> tuple[str, str | None, str | None]:
        """What sample ``index`` of ``epoch`` will be encoded from, without loading its image: its caption,
        its image's cache key and its conditioning image's (``None`` where there is no conditioning image,
        or where the latents are not cached: see :meth:`__getitem__`)."""
        caption, placement = self.caption(index, epoch)
        return (caption, *self._cache_keys(self.records[self.samples[index]], placement))

    def _cache_keys(self, record: ImageRecord, placement: Placement) -> tuple[str | None, str | None]:
        # A crop drawn at random differs every epoch: its latents are encoded each time, never cached.
        if not placement.is_fixed():
            return None, None
        encoded = record.conditioning is not None and record.subset.mask_source is None  # a mask is not encoded
        conditioning = (image_content_key(record.conditioning.sha256, placement, record.image.size)
                        if encoded else None)
        return image_content_key(record.image.sha256, placement), conditioning

    def encodes_in_the_loop(self) -> bool:
        """Whether some sample is a random crop with room to move, whose latents the loop encodes each time
        (so the VAE stays on the device)."""
        return any(r.subset.random_crop and r.resized != r.bucket for r in self.records)

    def __getitem__(self, key: int | SampleKey) -> dict[str, Any]:
        index, epoch = (key, 0) if isinstance(key, int) else key
        record = self.records[self.samples[index]]
        caption, placement = self.caption(index, epoch)
        (width, height), (bucket_w, bucket_h) = record.image.size, record.bucket
        image_key, conditioning_key = self._cache_keys(record, placement)
        item: dict[str, Any] = {
            "caption": caption,
            "original_size": (height, width),
            "crop_top_left": placement.crop_top_left(),
            "target_size": (bucket_h, bucket_w),
            "is_reg": record.subset.is_reg,
            "image_key": image_key,
            "image_path": str(record.image.path),
        }
        if self.text_cache is not None:
            item["text"] = self.text_cache.get(text_content_key(caption))
        self._add_pixels(item, "", record.image.path, record.image.size, placement)
        source = record.subset.mask_source
        if source is not None:
            conditioning = record.conditioning.path if record.conditioning is not None else None
            mask = read_mask(mask_path(record.image.path, conditioning, source), source)
            item["mask"] = torch.from_numpy(np.asarray(place_image(mask, record.image.size, placement),
                                                       dtype=np.float32) / 255.0)[None]  # (1, H, W) in [0, 1]
        elif record.conditioning is not None:
            item["conditioning_key"] = conditioning_key
            self._add_pixels(item, "conditioning_", record.conditioning.path, record.image.size, placement)
        return item

    def _add_pixels(self, item: dict[str, Any], prefix: str, path: Path, size: tuple[int, int],
                    placement: Placement) -> None:
        key = item[f"{prefix or 'image_'}key"]
        cached = self.latent_cache.get(key) if self.latent_cache is not None and key is not None else None
        if cached is not None:
            item[f"{prefix}latents"] = cached["latents"]
        else:
            item[f"{prefix}pixel_values"] = transform_image(load_rgb(path), size, placement)


def transform_image(image: Image.Image, size: tuple[int, int], placement: Placement) -> torch.Tensor:
    """Resize to ``size`` (a conditioning image to its target's size) and then as ``placement`` says;
    return (3, H, W) floats in [-1, 1]."""
    array = np.asarray(place_image(image, size, placement), dtype=np.uint8)  # (H, W, 3)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


def place_image(image: Image.Image, size: tuple[int, int], placement: Placement) -> Image.Image:
    """Resize to ``size``, then resize, crop and flip as ``placement`` says (an image, its condition, its mask)."""
    if image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
    if image.size != placement.resized:
        image = image.resize(placement.resized, Image.Resampling.LANCZOS)
    left, top = placement.crop_left, placement.crop_top
    image = image.crop((left, top, left + placement.bucket[0], top + placement.bucket[1]))
    if placement.flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image


def build_dataset(configs: Sequence[DatasetConfig], seed: int, latent_cache: TensorCache | None = None,
                  records: Sequence[list[ImageRecord]] | None = None,
                  text_cache: TensorCache | None = None) -> BucketDataset:
    """Scan, validate and bucket every dataset (errors name the file) and return the torch dataset, reading
    the caches given (see :class:`BucketDataset`); its ``skipped`` lists the files in the image folders that
    are not trained on, with the reason. ``records`` (one list per config, already collected) takes the place
    of the scan, e.g. a split's training part."""
    if records is None:
        records = [collect_records(c) for c in configs]
    dataset = BucketDataset([(r, c.batch_size, c.prior_pairs) for r, c in zip(records, configs, strict=True)],
                            seed, latent_cache, text_cache)
    dataset.skipped = [entry for c in configs for entry in skipped_in(c)]
    return dataset


class BucketBatchSampler(Sampler[list[SampleKey]]):
    """Batches of samples from one bucket, in an order fixed by (seed, epoch), like sd-scripts: each bucket's
    samples are shuffled and cut into batches of its dataset's batch size (the last may be shorter),
    then all batches are shuffled. A dataset with ``prior_pairs`` batches as diffusers' DreamBooth script
    does: its instance and class samples are shuffled apart, the shorter list is cycled to the length of
    the longer, and each batch holds the next instance samples followed by as many class samples.
    ``skip_batches`` drops the first batches of this epoch (exact resume). With ``num_replicas`` > 1
    the list is padded by repeating its start, then dealt round robin."""

    def __init__(self, dataset: BucketDataset, seed: int, epoch: int = 0, skip_batches: int = 0,
                 num_replicas: int = 1, rank: int = 0):
        self.dataset = dataset
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.set_epoch(epoch, skip_batches)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch to iterate, optionally skipping its first ``skip_batches`` batches (per rank)."""
        self.epoch = epoch
        self.skip_batches = skip_batches

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch`` (sample indices), before skipping."""
        rng = np.random.default_rng([self.seed, epoch, _BATCH_ORDER_STREAM])
        groups: dict[tuple[int, int, int], list[int]] = {}
        for index, group in enumerate(self.dataset.sample_group):
            groups.setdefault(group, []).append(index)
        batches = []
        for group in sorted(groups):
            members = [groups[group][i] for i in rng.permutation(len(groups[group]))]
            size = self.dataset.batch_sizes[group[0]]
            if self.dataset.prior_pairs[group[0]]:
                batches += self._prior_pairs(members, size)
            else:
                batches += [members[i:i + size] for i in range(0, len(members), size)]
        batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.num_replicas > 1:
            padding = (-len(batches)) % self.num_replicas
            batches = (batches + batches[:padding])[self.rank::self.num_replicas]
        return batches

    def _prior_pairs(self, members: list[int], size: int) -> list[list[int]]:
        """Batches of ``size`` instance samples, each followed by ``size`` class samples (shuffled members)."""
        dataset = self.dataset
        is_reg = [dataset.records[dataset.samples[i]].subset.is_reg for i in members]
        instance = [i for i, reg in zip(members, is_reg) if not reg]
        prior = [i for i, reg in zip(members, is_reg) if reg]
        if not instance or not prior:
            raise UserError("prior preservation needs instance and class images of the same size; "
                            "check --instance_data_dir and --class_data_dir")
        count = max(len(instance), len(prior))
        instance, prior = ([lst[i % len(lst)] for i in range(count)] for lst in (instance, prior))
        return [instance[i:i + size] + prior[i:i + size] for i in range(0, count, size)]

    def batches_per_epoch(self) -> int:
        """Batches per epoch for this rank (the same in every epoch)."""
        return len(self.epoch_batches(0))

    def __iter__(self) -> Iterator[list[SampleKey]]:
        for batch in self.epoch_batches(self.epoch)[self.skip_batches:]:
            yield [(index, self.epoch) for index in batch]

    def __len__(self) -> int:
        return max(0, self.batches_per_epoch() - self.skip_batches)


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack a same-bucket batch. Sizes become (B, 2) long tensors. ``pixel_values`` holds only the samples
    that were not served from the latent cache, at the positions listed in ``pixel_items``; ``latents``
    is their stack when every sample came from the cache, else a per-sample list with None where pixels were
    loaded (see :func:`~dreamstep.data.cache.latents_for_batch`); ``text`` likewise holds the cached text
    entries (:func:`~dreamstep.data.cache.stack_entries`), when the dataset reads them."""
    batch: dict[str, Any] = {
        "captions": [it["caption"] for it in items],
        "original_sizes": torch.tensor([it["original_size"] for it in items], dtype=torch.long),
        "crop_top_lefts": torch.tensor([it["crop_top_left"] for it in items], dtype=torch.long),
        "target_sizes": torch.tensor([it["target_size"] for it in items], dtype=torch.long),
        "is_reg": torch.tensor([it["is_reg"] for it in items], dtype=torch.bool),
        "image_keys": [it["image_key"] for it in items],
        "image_paths": [it["image_path"] for it in items],
    }
    if "text" in items[0]:
        batch["text"] = stack_entries([it["text"] for it in items])
    if "mask" in items[0]:
        batch["masks"] = torch.stack([it["mask"] for it in items])  # (B, 1, H, W)
    _stack_images(batch, items, "")
    if "conditioning_key" in items[0]:
        batch["conditioning_keys"] = [it["conditioning_key"] for it in items]
        _stack_images(batch, items, "conditioning_")
    return batch


def _stack_images(batch: dict[str, Any], items: list[dict[str, Any]], prefix: str) -> None:
    positions = [i for i, it in enumerate(items) if f"{prefix}pixel_values" in it]
    batch[f"{prefix}pixel_items"] = positions
    batch[f"{prefix}pixel_values"] = (torch.stack([items[i][f"{prefix}pixel_values"] for i in positions])
                                      if positions else None)
    latents = [it.get(f"{prefix}latents") for it in items]
    batch[f"{prefix}latents"] = torch.stack(latents) if not positions else latents


def make_dataloader(dataset: BucketDataset, seed: int, epoch: int = 0, skip_batches: int = 0,
                    num_workers: int = 0, num_replicas: int = 1, rank: int = 0) -> DataLoader:
    """A DataLoader over bucketed batches; call ``loader.batch_sampler.set_epoch(e)`` before each epoch.
    Its workers live as long as the loader (the sampler that chooses the batches runs in the trainer), and
    on a CUDA machine batches come in pinned memory, so their copies to the GPU need not wait. The workers'
    seed comes from the loader's own generator: persistent workers draw it once, workers made each epoch
    every epoch, and the global RNG (the training noise) must not depend on which."""
    sampler = BucketBatchSampler(dataset, seed, epoch, skip_batches, num_replicas, rank)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
                      worker_init_fn=_leave_signals_to_the_trainer, generator=torch.Generator().manual_seed(seed))


def _leave_signals_to_the_trainer(worker_id: int) -> None:
    """Ctrl-C reaches every process of the terminal's group, and a scheduler's SIGTERM every process of
    the job: workers ignore both, so the trainer can finish its step and save (the loader ends them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ConditionedBatches:
    """A loader's batches passed through a conditioner (cached latents and embeddings), keeping the
    loader's length and epoch control (``batch_sampler.set_epoch``) visible to the training loop."""

    def __init__(self, loader: Any, conditioner: Any):
        self.loader = loader
        self.batch_sampler = loader.batch_sampler
        self.conditioner = conditioner

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        # The loader's iterator is made here, not at the first batch, as a DataLoader's own iter() does: one
        # without its own generator draws the epoch's worker seed from the global RNG at that moment (see the
        # training loop's resume).
        batches = iter(self.loader)
        return (self.conditioner(batch) for batch in batches)
