"""LoRAs in ``dreamstep generate``: files made by the trainers' own code, converted to every layout, give
the same image as the original; merged equals adapters; several LoRAs combine with their weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from generation_testkit import generate

from dreamstep.lora.convert import convert_lora
from dreamstep.lora.formats import folder_configs
from dreamstep.png_text import read_parameters

# Images are uint8; the same LoRA reached by another route may round a few values the other way.
SAME = 3
# A LoRA's effect on the tiny models' 32x32 images, in uint8 levels: well above SAME.
CHANGED = 12


def test_flux_lora_changes_the_image_and_its_kohya_form_gives_the_same(
        tiny_flux_dev_dir: Path, flux_lora: Path, tmp_path: Path) -> None:
    kohya = tmp_path / "kohya.safetensors"
    convert_lora(flux_lora, kohya, "kohya", configs=folder_configs(tiny_flux_dev_dir))
    base = generate("flux", tiny_flux_dev_dir, tmp_path / "base")
    adapters = generate("flux", tiny_flux_dev_dir, tmp_path / "adapters", "--lora", flux_lora)
    from_kohya = generate("flux", tiny_flux_dev_dir, tmp_path / "kohya", "--lora", kohya)
    assert np.abs(adapters - base).max() > CHANGED
    np.testing.assert_allclose(from_kohya, adapters, atol=SAME)


def test_flux_merge_equals_adapters(tiny_flux_dev_dir: Path, flux_lora: Path, flux_lora_2: Path,
                                    tmp_path: Path) -> None:
    loras = ("--lora", f"{flux_lora}:0.7", "--lora", f"{flux_lora_2}:-0.4")
    adapters = generate("flux", tiny_flux_dev_dir, tmp_path / "adapters", *loras)
    merged = generate("flux", tiny_flux_dev_dir, tmp_path / "merged", *loras, "--merge")
    np.testing.assert_allclose(merged, adapters, atol=SAME)
    text, params = read_parameters(next((tmp_path / "merged").glob("*.png")))
    assert params["loras"] == [{"path": str(flux_lora), "weight": 0.7}, {"path": str(flux_lora_2), "weight": -0.4}]
    assert params["merge"] is True and f'Lora: "{flux_lora.stem}:0.7, {flux_lora_2.stem}:-0.4"' in text


def test_second_lora_at_weight_zero_changes_nothing(tiny_flux_dev_dir: Path, flux_lora: Path, flux_lora_2: Path,
                                                    tmp_path: Path) -> None:
    alone = generate("flux", tiny_flux_dev_dir, tmp_path / "alone", "--lora", flux_lora)
    both = generate("flux", tiny_flux_dev_dir, tmp_path / "both", "--lora", f"{flux_lora}:1.0", f"{flux_lora_2}:0.0")
    second = generate("flux", tiny_flux_dev_dir, tmp_path / "second", "--lora", flux_lora_2)
    np.testing.assert_allclose(both, alone, atol=SAME)
    assert np.abs(second - alone).max() > CHANGED


def test_sdxl_kohya_lora_in_every_layout_gives_the_same_image(tiny_sdxl_dir: Path, sdxl_kohya_lora: Path,
                                                              tmp_path: Path) -> None:
    configs = folder_configs(tiny_sdxl_dir)
    diffusers_file = tmp_path / "diffusers.safetensors"
    mindspore_file = tmp_path / "mindspore.ckpt"
    convert_lora(sdxl_kohya_lora, diffusers_file, "diffusers", configs=configs)
    convert_lora(sdxl_kohya_lora, mindspore_file, "mindspore", configs=configs)
    base = generate("sdxl", tiny_sdxl_dir, tmp_path / "base")
    original = generate("sdxl", tiny_sdxl_dir, tmp_path / "kohya", "--lora", sdxl_kohya_lora)
    assert np.abs(original - base).max() > CHANGED
    for name, file in (("diffusers", diffusers_file), ("mindspore", mindspore_file)):
        converted = generate("sdxl", tiny_sdxl_dir, tmp_path / name, "--lora", file, "--merge")
        np.testing.assert_allclose(converted, original, atol=SAME, err_msg=name)

