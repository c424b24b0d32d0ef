"""The content-keyed cache: hits on unchanged content, misses on changed bytes, transform or model."""

from pathlib import Path

import pytest
import torch
from data_testkit import write_gradient

from dreamstep.data.buckets import BucketSpec
from dreamstep.data.cache import TensorCache, latents_for_batch, text_content_key
from dreamstep.data.dataset import build_dataset, collate
from dreamstep.data.dataset_config import DatasetConfig, SubsetConfig
from dreamstep.errors import UserError


def fake_vae(pixels: torch.Tensor) -> torch.Tensor:
    """A stand-in encoder with the VAE's shape contract: (B, 3, H, W) -> (B, 4, H/8, W/8)."""
    pooled = torch.nn.functional.avg_pool2d(pixels, 8)
    return torch.cat([pooled, pooled.mean(1, keepdim=True)], dim=1)


class CountingEncoder:
    def __init__(self):
        self.calls = 0

    def __call__(self, pixels):
        self.calls += pixels.shape[0]
        return fake_vae(pixels)


def config(folder: Path, random_crop=False, flip=False) -> DatasetConfig:
    subset = SubsetConfig(where="test", image_dir=folder, class_tokens="sks", caption_extension=None,
                          random_crop=random_crop, flip_aug=flip)
    return DatasetConfig("test", "dreambooth", BucketSpec((64, 64)), 1, (subset,))


def test_hit_on_unchanged_content_across_runs(tmp_path: Path):
    folder = tmp_path / "imgs"
    write_gradient(folder / "a.png", (96, 64))
    cache_dir = tmp_path / "cache"
    encoder = CountingEncoder()
    first_run = TensorCache(cache_dir, "vae@v1", image_dirs=[folder])
    batch = collate([build_dataset([config(folder)], seed=0, latent_cache=first_run)[0]])
    latents = latents_for_batch(batch, encoder, first_run)
    assert encoder.calls == 1 and latents.shape == (1, 4, 8, 8)

    second_run = TensorCache(cache_dir, "vae@v1", image_dirs=[folder])
    item = build_dataset([config(folder)], seed=0, latent_cache=second_run)[0]
    assert "pixel_values" not in item  # served from the cache, no image decode
    again = latents_for_batch(collate([item]), encoder, second_run)
    assert encoder.calls == 1 and torch.equal(again, latents)
    assert not any(p.suffix == ".safetensors" for p in folder.rglob("*"))


def test_miss_on_changed_bytes_transform_or_model(tmp_path: Path):
    folder = tmp_path / "imgs"
    write_gradient(folder / "a.png", (96, 64))
    cache = TensorCache(tmp_path / "cache", "vae@v1")
    key = build_dataset([config(folder)], seed=0)[0]["image_key"]
    cache.put(key, {"latents": torch.ones(4, 8, 8)})
    assert cache.get(key) is not None
    assert TensorCache(tmp_path / "cache", "vae@v2").get(key) is None  # another model
    flipped = build_dataset([config(folder, flip=True)], seed=0)
    keys = {flipped[(0, e)]["image_key"] for e in range(8)}
    assert key in keys and len(keys) == 2  # the flipped transform is its own entry
    write_gradient(folder / "a.png", (96, 65))  # new bytes (and size)
    changed = build_dataset([config(folder)], seed=0)[0]["image_key"]
    assert changed != key and cache.get(changed) is None


def test_text_entries_keyed_by_caption(tmp_path: Path):
    cache = TensorCache(tmp_path / "cache", "t5@abc")
    calls = []

    def encode(missing):  # each computed entry holds the number of its call
        calls.append(list(missing))
        return {"prompt_embeds": torch.full((len(missing), 3), float(len(calls)))}

    keys = [text_content_key(c) for c in ["a dog", "a cat"]]
    first = cache.get_or_compute(keys, encode)
    second = cache.get_or_compute([keys[1], text_content_key("a cow"), keys[0]], encode)
    # Stored entries are computed one at a time, so none depends on its batch mates.
    assert calls == [[0], [1], [1]]
    assert second["prompt_embeds"][:, 0].tolist() == [2.0, 3.0, 1.0]
    assert torch.equal(second["prompt_embeds"][0], first["prompt_embeds"][1])
    assert torch.equal(second["prompt_embeds"][2], first["prompt_embeds"][0])


def test_cache_never_inside_image_folder(tmp_path: Path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    with pytest.raises(UserError, match="is inside the image folder"):
        TensorCache(folder / "cache", "vae", image_dirs=[folder])


def test_unreadable_entry_is_a_miss_and_is_rewritten(tmp_path: Path):
    cache = TensorCache(tmp_path / "cache", "vae")
    cache.path("k").parent.mkdir(parents=True, exist_ok=True)
    cache.path("k").write_bytes(b"half a file")
    assert cache.get("k") is None
    cache.put("k", {"latents": torch.zeros(2)})
    assert torch.equal(cache.get("k")["latents"], torch.zeros(2))
    assert not list(cache.path("k").parent.glob("*.tmp"))


def test_non_finite_latents_stop_at_encode_time_naming_the_image_and_the_fix(tmp_path: Path):
    from dreamstep.models.sdxl.plumbing import SDXLConditioner
    from dreamstep.models.sdxl.tiny import build_tiny_sdxl

    folder = tmp_path / "imgs"
    write_gradient(folder / "a.png", (64, 64))
    pipe = build_tiny_sdxl(seed=0)
    with torch.no_grad():  # what an fp16 VAE does on some images: activations past the float range
        pipe.vae.encoder.conv_in.weight.mul_(1e38)
    cache = TensorCache(tmp_path / "cache", "vae@v1")
    conditioner = SDXLConditioner(pipe, device=torch.device("cpu"), latent_cache=cache, text_cache=None,
                                  encode_text=False)
    batch = collate([build_dataset([config(folder)], seed=0, latent_cache=cache)[0]])
    with pytest.raises(UserError, match=r"a\.png: the VAE encoded this image to NaN/inf latents.*--no_half_vae"):
        conditioner.latents(batch)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing non-finite was cached


def test_a_random_crop_with_no_room_to_move_is_cached_and_one_with_room_is_not(tmp_path: Path):
    folder = tmp_path / "imgs"
    write_gradient(folder / "fits.png", (64, 64))  # already the bucket's size: every random crop is the image
    write_gradient(folder / "wide.png", (96, 64))  # a random crop moves: new pixels every epoch
    cache = TensorCache(tmp_path / "cache", "vae@v1")
    dataset = build_dataset([config(folder, random_crop=True)], seed=0, latent_cache=cache)
    encoder = CountingEncoder()
    for epoch in range(3):
        items = [dataset[(i, epoch)] for i in range(len(dataset))]
        latents_for_batch(collate(items), encoder, cache)
    # fits.png: encoded once, then served from the cache; wide.png: encoded every epoch, never stored.
    assert encoder.calls == 1 + 3
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 1


def test_entries_read_once_are_kept_in_memory_within_the_budget(tmp_path: Path):
    entry = {"latents": torch.ones(4, 8, 8)}  # 1 KiB
    cache = TensorCache(tmp_path / "cache", "vae@v1", memory_budget=2 * 1024)
    keys = [text_content_key(f"caption {i}") for i in range(3)]
    for key in keys:
        cache.put(key, entry)
    assert torch.equal(cache.get(keys[0])["latents"], entry["latents"])
    cache.path(keys[0]).unlink()
    assert cache.get(keys[0]) is not None  # served from memory
    cache.get(keys[1])
    cache.get(keys[2])  # the budget holds two entries: the least recently used one goes
    assert cache.get(keys[0]) is None
    assert TensorCache(tmp_path / "cache", "vae@v1").get(keys[1]) is not None
