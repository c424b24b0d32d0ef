"""The FLUX trainers follow diffusers' reference scripts where no seed says otherwise: their defaults,
and prior preservation as ``train_dreambooth_lora_flux.py`` batches it."""

from __future__ import annotations

import argparse

import pytest
from torch import nn

from dreamstep.config.flux_controlnet import FluxControlNetConfig
from dreamstep.config.flux_lora import FluxLoraConfig
from dreamstep.config.schema import add_arguments, build_config
from dreamstep.engine.logging import LABEL_WIDTH
from dreamstep.recipes import flux_lora


def _lora_config(**values) -> FluxLoraConfig:
    return build_config(FluxLoraConfig, {"pretrained_model_name_or_path": "unused", "output_dir": "unused",
                                                   "instance_data_dir": "unused", "instance_prompt": "x", **values})


def test_flux_lora_text_encoder_group_has_diffusers_learning_rate_and_weight_decay() -> None:
    config = _lora_config(train_text_encoder=True)
    transformer, text_encoder = nn.Linear(2, 2), nn.Linear(2, 2)
    main, text = flux_lora.optimizer_groups(config, transformer, text_encoder)
    assert (main["lr"], main["weight_decay"]) == (1e-4, 1e-4)
    assert (text["lr"], text["weight_decay"]) == (5e-6, 1e-3)
    assert text["params"] == list(text_encoder.parameters())


def test_flux_controlnet_defaults_are_diffusers_controlnet_defaults() -> None:
    config = build_config(FluxControlNetConfig, {
        "pretrained_model_name_or_path": "unused", "output_dir": "unused", "train_data_dir": "unused"})
    assert (config.learning_rate, config.adam_weight_decay, config.weighting_scheme) == (5e-6, 1e-2, "logit_normal")
    assert (_lora_config().learning_rate, _lora_config().weighting_scheme) == (1e-4, "none")


@pytest.mark.parametrize("config_class, source", [(FluxLoraConfig, "diffusers' default"),
                                                  (FluxControlNetConfig, "diffusers' ControlNet default")])
def test_help_says_where_differing_defaults_come_from(config_class: type, source: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, config_class)
    assert source in " ".join(parser.format_help().split())


@pytest.mark.parametrize("batch_size", [1, 2])
def test_prior_preservation_pairs_every_batch_and_cycles_through_all_class_images(tmp_path, batch_size: int) -> None:
    from PIL import Image

    from dreamstep.data.dataset import build_dataset, make_dataloader
    from dreamstep.data.sources import bucket_spec, dreambooth_from_flags

    for folder, count in (("instance", 3), ("class", 10)):
        (tmp_path / folder).mkdir()
        for i in range(count):
            Image.new("RGB", (32, 32), (20 * i, 100, 50)).save(tmp_path / folder / f"{i}.png")
    config = dreambooth_from_flags(tmp_path / "instance", "a photo of sks dog", class_data_dir=tmp_path / "class",
                                   class_prompt="a photo of a dog", buckets=bucket_spec(32), batch_size=batch_size)
    dataset = build_dataset([config], seed=0)
    loader = make_dataloader(dataset, seed=0)
    seen_class, seen_instance = set(), set()
    for batch in loader:
        is_reg = batch["is_reg"].tolist()
        assert is_reg == [False] * batch_size + [True] * batch_size  # instance samples, then as many class samples
        seen_instance |= {p for p, reg in zip(batch["image_paths"], is_reg) if not reg}
        seen_class |= {p for p, reg in zip(batch["image_paths"], is_reg) if reg}
    assert len(loader) == 10 // batch_size  # an epoch is the longer list: every class image once
    assert len(seen_class) == 10 and len(seen_instance) == 3


def test_help_says_a_dataset_toml_keeps_sd_scripts_balancing() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, FluxLoraConfig)
    text = " ".join(parser.format_help().split())
    assert "is_reg subsets are balanced against the training images as in sd-scripts" in text
    assert "every batch holds its instance samples and as many class samples" in text


def test_random_crops_of_bucket_sized_images_are_cached(tiny_flux_dir, tmp_path) -> None:
    from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli

    cache = tmp_path / "cache"
    # The robot images are 96x96: at --resolution 96 the default random crop has no room to move.
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir",
                   tmp_path / "out", "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT,
                   "--resolution", "96", "--max_train_steps", "2", "--report_to", "none", "--checkpointing_steps",
                   "0", "--cache_dir", cache) == 0
    # The epoch's samples are encoded and cached before the loop, one per image (with the cache off, as
    # before, none would be).
    images = [p for p in ROBOT_DIR.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp")]
    assert len([p for p in cache.rglob("*.safetensors") if "latents" in p.parts]) == len(images) > 2


def _final_grid(out) -> tuple[int, list[tuple[int, int]]]:
    """The final validation grid's width, and each sample's (width, height) from its PNG text."""
    import json

    from PIL import Image

    from dreamstep.png_text import JSON_KEY

    (path,) = (out / "samples").glob("final-*.png")
    grid = Image.open(path)
    return grid.width, [(cell["width"], cell["height"]) for cell in json.loads(grid.text[JSON_KEY])["images"]]


def test_validation_runs_at_the_dataset_tomls_resolution(tiny_flux_dir, tmp_path) -> None:
    from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli

    toml = tmp_path / "dataset.toml"  # the robot images are 96x96; the TOML trains them at 32 (not --resolution)
    toml.write_text(f"[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = '{ROBOT_DIR.as_posix()}'\n"
                    f"class_tokens = '{ROBOT_PROMPT}'\n")
    out = tmp_path / "out"
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   "--dataset_config", toml, "--max_train_steps", "1", "--report_to", "none", "--checkpointing_steps",
                   "0", "--validation_prompt", ROBOT_PROMPT, "--num_validation_images", "1",
                   "--validation_inference_steps", "1") == 0
    assert _final_grid(out) == (max(32, LABEL_WIDTH), [(32, 32)])  # the cell widened for the sample's label


def test_controlnet_validation_runs_at_the_training_resolution(tiny_flux_dir, tmp_path) -> None:
    from flux_testkit import run_cli
    from PIL import Image

    for folder in ("images", "conditioning"):
        (tmp_path / folder).mkdir()
        for i in range(2):
            Image.new("RGB", (32, 32), (60 * i, 90, 30)).save(tmp_path / folder / f"pair_{i}.png")
            (tmp_path / "images" / f"pair_{i}.txt").write_text("a shape")
    control = tmp_path / "control.png"
    Image.new("RGB", (48, 48), "white").save(control)  # another size than the training resolution
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"[general]\ncaption_extension = '.txt'\n[[datasets]]\nresolution = 32\n[[datasets.subsets]]\n"
                    f"image_dir = '{(tmp_path / 'images').as_posix()}'\n"
                    f"conditioning_data_dir = '{(tmp_path / 'conditioning').as_posix()}'\n")
    out = tmp_path / "out"
    assert run_cli("train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   "--dataset_config", toml, "--num_double_layers", "1", "--num_single_layers", "0",
                   "--max_train_steps", "1", "--report_to", "none", "--checkpointing_steps", "0",
                   "--validation_prompt", "a shape", "--validation_image", control, "--num_validation_images", "1",
                   "--validation_inference_steps", "1") == 0
    # the control image beside one sample, both 32 wide, in a cell widened for the label
    assert _final_grid(out) == (max(2 * 32, LABEL_WIDTH), [(32, 32)])
