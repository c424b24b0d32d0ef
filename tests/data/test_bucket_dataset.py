"""The torch dataset, the bucket batch sampler and the collate function."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from data_testkit import write_gradient, write_image
from PIL import Image

from dreamstep.data.buckets import BucketSpec
from dreamstep.data.captions import CaptionOptions
from dreamstep.data.dataset import BucketBatchSampler, BucketDataset, build_dataset, collate, make_dataloader
from dreamstep.data.dataset_config import DatasetConfig, SubsetConfig, load_dataset_config
from dreamstep.data.records import collect_records
from dreamstep.data.sources import controlnet_from_flags
from dreamstep.errors import UserError

BUCKETS = BucketSpec((256, 256), enable_bucket=True, min_bucket_reso=128, max_bucket_reso=512, bucket_reso_steps=64)


def one_subset(folder: Path, random_crop=False, flip_aug=False, repeats=1, buckets=BUCKETS, batch_size=1,
               captions=CaptionOptions()) -> DatasetConfig:
    subset = SubsetConfig(where="test", image_dir=folder, class_tokens="sks, dog, red, blue", num_repeats=repeats,
                          random_crop=random_crop, flip_aug=flip_aug, caption_extension=None,
                          captions=captions)
    return DatasetConfig("test", "dreambooth", buckets, batch_size, (subset,))


def expected_pixels(path: Path, resized, left, top, bucket, flip=False) -> torch.Tensor:
    image = Image.open(path).convert("RGB").resize(resized, Image.Resampling.LANCZOS)
    image = image.crop((left, top, left + bucket[0], top + bucket[1]))
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 127.5 - 1


def test_true_crop_offsets_for_a_bucketed_image(tmp_path: Path):
    path = write_gradient(tmp_path / "imgs" / "tall.png", (100, 333))
    dataset = build_dataset([one_subset(path.parent)], seed=0)
    item = dataset[0]
    # Bucket 128x448; the image is resized to 135x448 and 7 columns are cut, 3 on the left. sd-scripts
    # would report (10, 0) here: the offset of the image fitted *inside* the bucket, not of the crop.
    assert item["original_size"] == (333, 100)
    assert item["target_size"] == (448, 128)
    assert item["crop_top_left"] == (0, 3)
    assert item["pixel_values"].shape == (3, 448, 128)
    assert torch.equal(item["pixel_values"], expected_pixels(path, (135, 448), 3, 0, (128, 448)))


def test_random_crop_offsets_match_pixels(tmp_path: Path):
    path = write_gradient(tmp_path / "imgs" / "wide.png", (300, 200))
    dataset = build_dataset([one_subset(path.parent, random_crop=True, flip_aug=True, repeats=8)], seed=3)
    seen = set()
    for index in range(len(dataset)):
        item = dataset[(index, 1)]
        placement, _ = dataset.placement(index, 1)
        top, left = item["crop_top_left"]
        assert (top, left) == placement.crop_top_left()
        seen.add((placement.crop_top, placement.flip))
        expected = expected_pixels(path, (320, 213), placement.crop_left, placement.crop_top, (320, 192),
                                   placement.flip)
        assert torch.equal(item["pixel_values"], expected)
        assert item["pixel_values"].min() >= -1 and item["pixel_values"].max() <= 1
    assert len(seen) > 2


def test_items_reproducible_per_seed_and_epoch(tmp_path: Path):
    folder = tmp_path / "imgs"
    write_image(folder / "a.png", (64, 64))
    config = one_subset(folder, random_crop=True, flip_aug=True, repeats=4,
                        captions=CaptionOptions(shuffle_caption=True, keep_tokens=1))
    first, second = build_dataset([config], seed=5), build_dataset([config], seed=5)
    for key in [(0, 0), (3, 2)]:
        assert first[key]["caption"] == second[key]["caption"]
        assert first[key]["image_key"] == second[key]["image_key"]
    captions = {first[(i, e)]["caption"] for i in range(4) for e in range(4)}
    assert len(captions) > 1 and all(c.startswith("sks, ") for c in captions)


def _dataset(tmp_path: Path, sizes, batch_size=2, repeats=1, seed=0) -> BucketDataset:
    folder = tmp_path / "mixed"
    for i, size in enumerate(sizes):
        write_image(folder / f"{i:02d}.png", size)
    return BucketDataset([(collect_records(one_subset(folder, repeats=repeats)), batch_size, False)], seed)


SIZES = [(64, 64)] * 5 + [(100, 60)] * 4 + [(40, 120)] * 3


def test_batches_stay_in_one_bucket_and_cover_every_sample(tmp_path: Path):
    dataset = _dataset(tmp_path, SIZES, batch_size=2, repeats=2)
    sampler = BucketBatchSampler(dataset, seed=1)
    batches = list(sampler)
    assert sorted(i for b in batches for i, _ in b) == list(range(len(dataset)))  # each sample once
    for batch in batches:
        assert len({dataset.sample_group[i] for i, _ in batch}) == 1 and 1 <= len(batch) <= 2
    # buckets of 10, 8 and 6 samples -> 5 + 4 + 3 batches
    assert len(batches) == len(sampler) == 12


def test_batch_order_deterministic_and_resumable(tmp_path: Path):
    dataset = _dataset(tmp_path, SIZES, batch_size=2)
    a, b = BucketBatchSampler(dataset, seed=4, epoch=2), BucketBatchSampler(dataset, seed=4, epoch=2)
    assert list(a) == list(b)
    assert list(BucketBatchSampler(dataset, seed=4, epoch=3)) != list(a)
    resumed = BucketBatchSampler(dataset, seed=4, epoch=2, skip_batches=3)
    assert list(resumed) == list(a)[3:] and len(resumed) == len(a) - 3


def test_replicas_split_the_batches(tmp_path: Path):
    dataset = _dataset(tmp_path, SIZES, batch_size=2)
    ranks = [list(BucketBatchSampler(dataset, seed=0, num_replicas=2, rank=r)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 4
    everything = {i for batches in ranks for b in batches for i, _ in b}
    assert everything == set(range(len(dataset)))


def test_dataloader_collates_and_matches_across_workers(tmp_path: Path):
    dataset = _dataset(tmp_path, SIZES, batch_size=3)
    serial = list(make_dataloader(dataset, seed=2, epoch=1))
    parallel = list(make_dataloader(dataset, seed=2, epoch=1, num_workers=2))
    assert len(serial) == len(parallel)
    for x, y in zip(serial, parallel):
        assert x["image_keys"] == y["image_keys"] and torch.equal(x["pixel_values"], y["pixel_values"])
    batch = serial[0]
    n = len(batch["captions"])
    assert batch["pixel_values"].shape[0] == n and batch["pixel_items"] == list(range(n))
    assert batch["original_sizes"].shape == batch["crop_top_lefts"].shape == batch["target_sizes"].shape == (n, 2)
    assert batch["is_reg"].dtype == torch.bool and batch["latents"] == [None] * n
    assert tuple(batch["pixel_values"].shape[2:]) == tuple(batch["target_sizes"][0].tolist())


def test_conditioning_gets_the_same_crop_and_flip(tmp_path: Path):
    images, cond = tmp_path / "img", tmp_path / "cond"
    write_gradient(images / "a.png", (300, 200))
    cond.mkdir()
    shutil.copy(images / "a.png", cond / "a.png")
    config = controlnet_from_flags(train_data_dir=images, conditioning_data_dir=cond, default_caption="x",
                                   buckets=BUCKETS, random_flip=True, repeats=6)
    dataset = build_dataset([config], seed=0)
    flips = set()
    for index in range(len(dataset)):
        item = dataset[(index, 0)]
        assert torch.equal(item["pixel_values"], item["conditioning_pixel_values"])
        flips.add(dataset.placement(index, 0)[0].flip)
    assert flips == {True, False}
    batch = collate([dataset[0], dataset[1]])
    assert batch["conditioning_pixel_values"].shape == batch["pixel_values"].shape
    assert len(batch["conditioning_keys"]) == 2


def test_smaller_conditioning_image_is_fitted_to_its_target(tmp_path: Path):
    images, cond = tmp_path / "img", tmp_path / "cond"
    write_gradient(images / "a.png", (300, 200))
    write_gradient(cond / "a.png", (150, 100))
    config = controlnet_from_flags(train_data_dir=images, conditioning_data_dir=cond, default_caption="x",
                                   buckets=BUCKETS)
    item = build_dataset([config], seed=0)[0]
    assert item["conditioning_pixel_values"].shape == item["pixel_values"].shape
    assert (item["conditioning_pixel_values"] - item["pixel_values"]).abs().mean() < 0.05


def test_mismatched_pair_rejected(tmp_path: Path):
    images, cond = tmp_path / "img", tmp_path / "cond"
    write_image(images / "a.png", (300, 200))
    write_image(cond / "a.png", (200, 200))
    config = controlnet_from_flags(train_data_dir=images, conditioning_data_dir=cond, default_caption="x")
    with pytest.raises(UserError, match="same aspect ratio"):
        build_dataset([config], seed=0)


def test_kohya_toml_to_dataloader(tmp_path: Path):
    for i, size in enumerate([(300, 200), (310, 205), (200, 300), (256, 256)]):
        write_image(tmp_path / "train" / f"t{i}.png", size)
    for i in range(3):
        write_image(tmp_path / "reg" / f"r{i}.png", (256, 256))
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"""
[general]
enable_bucket = true
min_bucket_reso = 128
max_bucket_reso = 512
shuffle_caption = true
keep_tokens = 1

[[datasets]]
resolution = 256
batch_size = 2

  [[datasets.subsets]]
  image_dir = '{tmp_path / "train"}'
  class_tokens = 'sks, dog'
  num_repeats = 2

  [[datasets.subsets]]
  image_dir = '{tmp_path / "reg"}'
  class_tokens = 'dog'
  is_reg = true
""")
    dataset = build_dataset(load_dataset_config(toml, cli={"resolution": 1024}), seed=0)
    assert len(dataset) == 16  # 4 images x 2 repeats, and reg balanced to 8 samples
    loader = make_dataloader(dataset, seed=0)
    batches = list(loader)
    assert sum(len(b["captions"]) for b in batches) == 16
    assert int(sum(b["is_reg"].sum() for b in batches)) == 8
    sizes = {tuple(b["target_sizes"][0].tolist()) for b in batches}
    assert sizes == {(192, 320), (320, 192), (256, 256)}


def test_only_random_crops_with_room_to_move_are_encoded_in_the_loop(tmp_path: Path):
    """What the loop reads and what is cached before it agree: a random crop with room to move has no cache key
    (it is encoded every step, so the VAE stays on the device); a bucket-sized image's crop, flipped or not, has."""
    wide = write_gradient(tmp_path / "wide" / "a.png", (300, 200))
    square = write_image(tmp_path / "square" / "a.png", (256, 256))
    moving = build_dataset([one_subset(wide.parent, random_crop=True, flip_aug=True)], seed=0)
    fixed = build_dataset([one_subset(square.parent, random_crop=True, flip_aug=True)], seed=0)
    assert moving.encodes_in_the_loop() and not fixed.encodes_in_the_loop()
    assert moving.caption_and_keys(0, 0)[1] is None and moving[(0, 0)]["image_key"] is None
    assert fixed.caption_and_keys(0, 0)[1] == fixed[(0, 0)]["image_key"] is not None


def test_workers_read_cached_entries_and_serve_every_epoch_alike(tmp_path: Path):
    """Cached latents and text entries come read and stacked with the batch, from workers that live across
    epochs, and the epochs match a loader without workers, batch for batch."""
    from dreamstep.data.cache import TensorCache, text_content_key

    dataset = _dataset(tmp_path, SIZES, batch_size=3)
    latents, texts = TensorCache(tmp_path / "latents", "vae"), TensorCache(tmp_path / "text", "t5")
    for index in range(len(dataset)):
        item = dataset[(index, 0)]
        latents.put(item["image_key"], {"latents": torch.full((4, 2, 2), float(index))})
        texts.put(text_content_key(item["caption"]), {"prompt_embeds": torch.ones(5, 8)})
    dataset.latent_cache, dataset.text_cache = latents, texts
    serial, parallel = make_dataloader(dataset, seed=2), make_dataloader(dataset, seed=2, num_workers=2)
    worker_batches = []
    for epoch in range(2):
        for loader in (serial, parallel):
            loader.batch_sampler.set_epoch(epoch)
        worker_batches.append(list(parallel))
        if epoch == 0:
            workers = parallel._iterator._workers
        for x, y in zip(list(serial), worker_batches[-1], strict=True):
            assert x["image_keys"] == y["image_keys"] and torch.equal(x["latents"], y["latents"])
            assert y["pixel_values"] is None and y["text"]["prompt_embeds"].shape == (len(y["captions"]), 5, 8)
    assert parallel._iterator._workers == workers  # the same processes served the second epoch
