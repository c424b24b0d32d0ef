"""sd-scripts' caption flags on every trainer: they set the folder flags' subsets and are a dataset TOML's
lowest-precedence values; the draws are reproducible and a resumed run continues them; a dropped caption trains
on the empty caption's embedding, encoded once into the text cache before training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from dreamstep.config.flux_controlnet import FluxControlNetConfig
from dreamstep.config.flux_lora import FluxLoraConfig
from dreamstep.config.schema import build_config
from dreamstep.config.sdxl_lora import SDXLLoraConfig
from dreamstep.data.cache import TensorCache, text_content_key
from dreamstep.data.dataset import ConditionedBatches, build_dataset, make_dataloader
from dreamstep.data.sources import dreambooth_datasets, kohya_datasets, paired_datasets

CAPTION = "sks robot, red, standing, outdoors, daylight, smiling"


def _images(folder: Path, count: int = 4, caption: str = CAPTION) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (32, 32), (40 * i, 90, 30)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(caption)
    return folder


FLAGS = {"shuffle_caption": True, "keep_tokens": 1, "caption_dropout_rate": 0.25,
         "caption_dropout_every_n_epochs": 3, "caption_tag_dropout_rate": 0.1}


def test_flags_set_every_folder_subset_and_a_toml_subsets_own_keys_win(tmp_path: Path) -> None:
    images = _images(tmp_path / "img")
    _images(tmp_path / "sdxl" / "2_sks robot")
    (tmp_path / "cond").mkdir()
    for i in range(4):
        Image.new("RGB", (32, 32), "white").save(tmp_path / "cond" / f"{i}.png")
    base = {"output_dir": str(tmp_path / "o"), "pretrained_model_name_or_path": "m", "resolution": 32}
    built = [
        dreambooth_datasets(build_config(FluxLoraConfig, {**base, "instance_data_dir": str(images),
                                                         "instance_prompt": "x", **FLAGS}), None, "train flux-lora"),
        paired_datasets(build_config(FluxControlNetConfig, {**base, "train_data_dir": str(images),
                                                            "conditioning_data_dir": str(tmp_path / "cond"), **FLAGS}),
                        ("controlnet",), "train flux-controlnet"),
        kohya_datasets(build_config(SDXLLoraConfig, {**base, "resolution": "32", "caption_extension": ".txt",
                                                    "train_data_dir": str(tmp_path / "sdxl"), **FLAGS}),
                       "train sdxl-lora"),
    ]
    for datasets in built:
        for subset in datasets[0].subsets:
            assert {name: getattr(subset.captions, name) for name in FLAGS} == FLAGS

    toml = tmp_path / "dataset.toml"
    toml.write_text(f"[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = '{images.as_posix()}'\n"
                    "caption_extension = '.txt'\ncaption_dropout_rate = 0.5\n")
    config = build_config(FluxLoraConfig, {**base, "dataset_config": str(toml), **FLAGS})
    (subset,) = dreambooth_datasets(config, None, "train flux-lora")[0].subsets
    assert subset.captions.caption_dropout_rate == 0.5 and subset.captions.shuffle_caption is True


def test_proportion_empty_prompts_is_the_controlnet_name_of_caption_dropout(tmp_path: Path) -> None:
    import argparse

    from dreamstep.config.schema import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, FluxControlNetConfig)
    toml = tmp_path / "c.toml"
    toml.write_text("proportion_empty_prompts = 0.3\n")
    for argv, rate in ((["--proportion_empty_prompts", "0.2"], 0.2), (["--config", str(toml)], 0.3)):
        args = parser.parse_args(["--output_dir", "o", "--pretrained_model_name_or_path", "m", "--train_data_dir",
                                  "t", *argv])
        assert build_config(FluxControlNetConfig, args).caption_dropout_rate == rate


def _captions(loader) -> list[list[str]]:
    return [batch["captions"] for batch in loader]


def test_draws_are_reproducible_and_a_resumed_run_continues_them(tmp_path: Path) -> None:
    from dreamstep.data.sources import bucket_spec, dreambooth_from_flags, with_caption_flags

    config = with_caption_flags(dreambooth_from_flags(_images(tmp_path / "img", 6), None, caption_extension=".txt",
                                                      buckets=bucket_spec(32), repeats=2, batch_size=2), FLAGS)
    dataset = build_dataset([config], seed=3)
    loader = make_dataloader(dataset, seed=3)
    epochs = []
    for epoch in range(3):
        loader.batch_sampler.set_epoch(epoch)
        epochs.append(_captions(loader))
    flat = [c for epoch in epochs for batch in epoch for c in batch]
    assert "" in flat and len(set(flat)) > 3  # some dropped, tags shuffled and dropped
    assert all(c == "" for batch in epochs[2] for c in batch)  # every 3rd epoch drops every caption
    assert all(c.startswith("sks robot") for c in flat if c)  # keep_tokens 1
    # Another run of the same seed draws the same; one resumed after 2 batches of epoch 1 draws the rest.
    again = make_dataloader(build_dataset([config], seed=3), seed=3, epoch=0)
    assert _captions(again) == epochs[0]
    resumed = make_dataloader(build_dataset([config], seed=3), seed=3, epoch=1, skip_batches=2)
    assert _captions(resumed) == epochs[1][2:]
    other_seed = make_dataloader(build_dataset([config], seed=4), seed=4)
    assert _captions(other_seed) != epochs[0]


def test_a_dropped_caption_trains_on_the_cached_empty_embedding(tmp_path: Path) -> None:
    from dreamstep.data.sources import bucket_spec, dreambooth_from_flags, with_caption_flags
    from dreamstep.models import parking
    from dreamstep.models.flux import plumbing as flux
    from dreamstep.models.flux.tiny import build_tiny_flux

    pipe = build_tiny_flux(seed=0)
    config = with_caption_flags(dreambooth_from_flags(_images(tmp_path / "img"), None, caption_extension=".txt",
                                                      buckets=bucket_spec(32), batch_size=2),
                                {"caption_dropout_rate": 1.0})
    text_cache = TensorCache(tmp_path / "text", "text")
    dataset = build_dataset([config], seed=0, text_cache=text_cache)
    conditioner = flux.FluxConditioner(pipe, latent_cache=None, text_cache=text_cache, max_sequence_length=16,
                                       device=torch.device("cpu"))
    parking.fill_caches(conditioner, dataset, epochs=2)
    # The empty caption is the only one any sample trains with: it alone is encoded, once.
    assert list((tmp_path / "text").rglob("*.safetensors")) == [text_cache.path(text_content_key(""))]

    t5_calls = []
    pipe.text_encoder_2.register_forward_hook(lambda *_: t5_calls.append(1))
    with torch.no_grad():
        expected, pooled, _ = pipe.encode_prompt("", "", max_sequence_length=16)
    t5_calls.clear()
    batches = list(ConditionedBatches(make_dataloader(dataset, seed=0), conditioner))
    assert not t5_calls  # every batch came from the cache
    for batch in batches:
        assert torch.equal(batch["prompt_embeds"], expected.expand_as(batch["prompt_embeds"]))
        assert torch.equal(batch["pooled"], pooled.expand_as(batch["pooled"]))


@pytest.mark.parametrize("config_class, required", [
    (FluxLoraConfig, {"instance_data_dir": "i", "instance_prompt": "x"}),
    (SDXLLoraConfig, {"train_data_dir": "t"}),
])
def test_keep_tokens_without_shuffle_or_tag_dropout_is_refused(config_class: type, required: dict) -> None:
    from dreamstep.errors import UserError

    with pytest.raises(UserError, match="--keep_tokens has no effect without --shuffle_caption"):
        build_config(config_class, {"output_dir": "o", "pretrained_model_name_or_path": "m", **required,
                                    "keep_tokens": 2})
