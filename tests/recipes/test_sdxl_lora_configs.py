"""The shipped SDXL configs: the seed's command as a TOML gives the same config as its flags, and the seed's
three dataset TOMLs (comments and all) load and give the captions each method promises."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from sdxl_testkit import CAPTIONS, write_images

from dreamstep.config.schema import add_arguments, build_config, config_to_toml
from dreamstep.config.sdxl_lora import SDXLLoraConfig
from dreamstep.data import build_dataset
from dreamstep.data.sources import kohya_datasets

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SEED_COMMAND = [
    "--pretrained_model_name_or_path=path_to/sd_xl_base_1.0.safetensors",
    "--dataset_config=configs/sdxl_dataset_finetune.toml", "--network_module=networks.lora", "--network_alpha=256",
    "--network_dim=256", "--save_model_as=ckpt", "--learning_rate=1e-4", "--network_train_unet_only",
    "--network_dropout=0.1", "--no_half_vae", "--lr_scheduler=constant", "--optimizer_type=AdamW", "--optimizer_args",
    "weight_decay=0.05", "betas=0.9,0.98", "--max_data_loader_n_workers=0", "--max_train_steps=15000",
    "--save_precision=fp32", "--save_every_n_steps=3000", "--gradient_checkpointing", "--flash_attn",
    "--min_snr_gamma=5", "--noise_offset=0.0357", "--adaptive_noise_scale=0.00357", "--output_name=pokemon",
    "--output_dir=path_to/sdxl_lora_pokemon"
]


def test_seed_toml_equals_the_seed_command() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, SDXLLoraConfig)
    from_flags = build_config(SDXLLoraConfig, parser.parse_args(SEED_COMMAND))
    from_toml = build_config(SDXLLoraConfig, toml_path=CONFIGS / "sdxl_lora.toml")
    # Neither gives --seed: each config draws its own when it is built, and names it in its config.toml.
    assert from_flags.seed is not None and f"seed = {from_flags.seed}\n" in config_to_toml(from_flags)
    assert dataclasses.replace(from_toml, seed=from_flags.seed) == from_flags
    assert from_flags.optimizer_args == ["weight_decay=0.05", "betas=0.9,0.98"]
    assert (from_flags.network_dim, from_flags.network_alpha, from_flags.network_dropout) == (256, 256.0, 0.1)


def _localised(name: str, root: Path) -> Path:
    """The shipped dataset TOML with its folders pointed at small test images, at 64 px."""
    train, reg = root / "butterfly", root / "reg"
    for path, caption in zip(write_images(train), CAPTIONS):
        path.with_suffix(".txt").write_text(caption)
    write_images(reg, count=2, seed=1)
    (root / "metadata.json").write_text(json.dumps({f"img{i}": {"caption": c} for i, c in enumerate(CAPTIONS)}))
    text = (CONFIGS / name).read_text().replace("resolution = 1024", "resolution = 64")
    for placeholder, real in (("data_path/butterfly", train), ("path_to_regulation_dataset", reg),
                              ("data_path/pokemon_blip/train", train), ("data_path/metadata.json",
                                                                        root / "metadata.json")):
        text = text.replace(placeholder, real.as_posix())
    (root / name).write_text(text)
    return root / name


@pytest.mark.parametrize("name, train_captions, reg_caption", [
    ("sdxl_dataset_class_tokens.toml", {"Pokemon butterfly"}, "butterfly"),
    ("sdxl_dataset_captions.toml", set(CAPTIONS), "butterfly"),
    ("sdxl_dataset_finetune.toml", set(CAPTIONS), None),
])
def test_seed_dataset_tomls_give_each_methods_captions(name: str, train_captions: set, reg_caption: str | None,
                                                       tmp_path: Path) -> None:
    config = build_config(SDXLLoraConfig, {"pretrained_model_name_or_path": "x", "output_dir": "x",
                                           "dataset_config": str(_localised(name, tmp_path))})
    dataset = build_dataset(kohya_datasets(config, "train sdxl-lora"), seed=0)
    assert {r.caption for r in dataset.records if not r.subset.is_reg} == train_captions
    assert {r.caption for r in dataset.records if r.subset.is_reg} == ({reg_caption} if reg_caption else set())
    assert all(r.bucket == (64, 64) and r.subset.random_crop for r in dataset.records)
