"""--masked_loss's masks (sd-scripts' semantics): from the alpha channel or a conditioning folder, resized,
cropped and flipped with their image, never encoded by the VAE; a missing, misshapen or all-black mask is one
line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from dreamstep.config.flux_lora import FluxLoraConfig
from dreamstep.config.schema import build_config
from dreamstep.data.dataset import build_dataset, collate
from dreamstep.data.sources import dreambooth_datasets
from dreamstep.errors import UserError


def _half_transparent(path: Path, size: tuple[int, int] = (48, 32)) -> Path:
    """Black and opaque on the left half, transparent on the right (which load_rgb composites to white)."""
    image = Image.new("RGBA", size, (0, 0, 0, 0))
    image.paste((0, 0, 0, 255), (0, 0, size[0] // 2, size[1]))
    image.save(path)
    return path


def _toml(tmp_path: Path, subset: str) -> Path:
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"[[datasets]]\nresolution = 32\n[[datasets.subsets]]\n{subset}\n")
    return toml


def _datasets(toml: Path, masked_loss: bool = True):
    config = build_config(FluxLoraConfig, {"pretrained_model_name_or_path": "m", "output_dir": "o",
                                           "dataset_config": str(toml), "masked_loss": masked_loss})
    return dreambooth_datasets(config, None, "train flux-lora")


def test_an_alpha_mask_gets_its_images_crop_and_flip(tmp_path: Path) -> None:
    images = tmp_path / "img"
    images.mkdir()
    for i in range(3):
        _half_transparent(images / f"{i}.png")
        (images / f"{i}.txt").write_text("a shape")
    toml = _toml(tmp_path, f"image_dir = '{images.as_posix()}'\ncaption_extension = '.txt'\nalpha_mask = true\n"
                           "random_crop = true\nflip_aug = true")
    dataset = build_dataset(_datasets(toml), seed=0)
    seen_flips = set()
    for epoch in range(4):
        for index in range(len(dataset)):
            item = dataset[(index, epoch)]
            mask, pixels = item["mask"], item["pixel_values"]
            assert mask.shape == (1, 32, 32) and "conditioning_key" not in item
            # Opaque (mask 1) exactly where the composited pixels are black.
            assert torch.equal(mask[0] == 1.0, pixels[0] < 0) and torch.equal(mask[0] == 0.0, pixels[0] > 0)
            seen_flips.add(bool(mask[0, 0, 0] == 0))
    assert seen_flips == {True, False}  # flipped samples came with flipped masks
    batch = collate([dataset[(0, 0)], dataset[(1, 0)]])
    assert batch["masks"].shape == (2, 1, 32, 32)


def test_conditioning_masks_are_read_not_encoded(tmp_path: Path) -> None:
    images, masks = tmp_path / "img", tmp_path / "masks"
    images.mkdir(), masks.mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (200, 30, 30)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text("a shape")
        mask = Image.new("RGB", (32, 32), "black")
        mask.paste((255, 255, 255), (0, 0, 32, 8 * (i + 1)))
        mask.save(masks / f"{i}.png")
    toml = _toml(tmp_path, f"image_dir = '{images.as_posix()}'\ncaption_extension = '.txt'\n"
                           f"conditioning_data_dir = '{masks.as_posix()}'")
    dataset = build_dataset(_datasets(toml), seed=0)
    for index in range(2):
        caption, image_key, conditioning_key = dataset.caption_and_keys(index, 0)
        assert image_key is not None and conditioning_key is None  # only the image goes to the VAE
        mask = dataset[(index, 0)]["mask"][0]
        rows = 8 * (int(Path(dataset[(index, 0)]["image_path"]).stem) + 1)
        assert mask[:rows].eq(1).all() and mask[rows:].eq(0).all()


@pytest.mark.parametrize("case", ["all black", "no alpha", "no mask file", "other aspect ratio"])
def test_a_bad_mask_is_one_line_naming_the_file(case: str, tmp_path: Path) -> None:
    images, masks = tmp_path / "img", tmp_path / "masks"
    images.mkdir(), masks.mkdir()
    if case in ("all black", "no alpha"):
        bad = images / "0.png"
        Image.new("RGBA" if case == "all black" else "RGB", (32, 32), (0, 0, 0, 0) if case == "all black"
                  else "red").save(bad)
        subset = f"image_dir = '{images.as_posix()}'\nclass_tokens = 'x'\nalpha_mask = true"
        expected = {"all black": "the alpha channel is black everywhere", "no alpha": "has no alpha channel"}[case]
    else:
        Image.new("RGB", (32, 32), "red").save(images / "0.png")
        Image.new("RGB", (32, 32), "red").save(images / "1.png")
        Image.new("RGB", (32, 32), "white").save(masks / "0.png")
        bad = images / "1.png"
        expected = "no conditioning image named '1.*'"
        if case == "other aspect ratio":
            Image.new("RGB", (32, 64), "white").save(masks / "1.png")
            bad, expected = masks / "1.png", "a pair must have the same aspect ratio"
        subset = f"image_dir = '{images.as_posix()}'\nclass_tokens = 'x'\nconditioning_data_dir = '{masks.as_posix()}'"
    with pytest.raises(UserError) as error:
        build_dataset(_datasets(_toml(tmp_path, subset)), seed=0)
    message = str(error.value)
    assert str(bad) in message and expected in message and "\n" not in message


def test_masks_need_masked_loss_and_masked_loss_needs_masks(tmp_path: Path) -> None:
    images = tmp_path / "img"
    images.mkdir()
    _half_transparent(images / "0.png")
    with pytest.raises(UserError, match="alpha_mask = true has no effect without --masked_loss"):
        _datasets(_toml(tmp_path, f"image_dir = '{images.as_posix()}'\nclass_tokens = 'x'\nalpha_mask = true"),
                  masked_loss=False)
    with pytest.raises(UserError, match="--masked_loss needs a mask for every image"):
        _datasets(_toml(tmp_path, f"image_dir = '{images.as_posix()}'\nclass_tokens = 'x'"))
    with pytest.raises(UserError, match="--masked_loss reads its masks from a dataset TOML"):
        build_config(FluxLoraConfig, {"pretrained_model_name_or_path": "m", "output_dir": "o",
                                      "instance_data_dir": str(images), "instance_prompt": "x", "masked_loss": True})
