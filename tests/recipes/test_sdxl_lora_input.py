"""sdxl-lora input handling, all before a model loads: buckets, Kohya's folder flags, sample-prompt lines,
and one clear line with a non-zero exit for each kind of bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image
from sdxl_testkit import run_cli, write_images, write_method

from dreamstep.config.schema import build_config
from dreamstep.config.sdxl_lora import SDXLLoraConfig
from dreamstep.data import build_dataset
from dreamstep.data.sources import kohya_datasets
from dreamstep.errors import UserError
from dreamstep.models.sdxl.plumbing import parse_sample_prompt


def _config(**values) -> SDXLLoraConfig:
    return build_config(SDXLLoraConfig, {"pretrained_model_name_or_path": "unused", "output_dir": "unused", **values})


def test_buckets_of_odd_sized_images_are_sd_scripts_buckets(tmp_path: Path) -> None:
    sizes = {"wide": (300, 200), "tall": (200, 300), "strip": (500, 130), "square": (129, 131), "band": (700, 260)}
    for name, size in sizes.items():
        Image.new("RGB", size, (120, 60, 30)).save(tmp_path / f"{name}.png")
    toml = tmp_path / "buckets.toml"
    toml.write_text("[general]\nenable_bucket = true\nmin_bucket_reso = 128\nmax_bucket_reso = 512\n"
                    "bucket_reso_steps = 64\n[[datasets]]\nresolution = 256\n"
                    f"  [[datasets.subsets]]\n  image_dir = '{tmp_path.as_posix()}'\n  class_tokens = 'x'\n")
    dataset = build_dataset(kohya_datasets(_config(dataset_config=str(toml)), "train sdxl-lora"), seed=0)
    buckets = {record.image.path.stem: record.bucket for record in dataset.records}
    # max area 256², sides 128..512 in steps of 64; the bucket with the closest aspect ratio
    assert buckets == {"wide": (320, 192), "tall": (192, 320), "strip": (512, 128), "square": (256, 256),
                       "band": (384, 128)}


def test_kohya_folder_flags_make_dreambooth_subsets(tmp_path: Path) -> None:
    write_images(tmp_path / "train" / "10_sks dog", count=2)
    write_images(tmp_path / "reg" / "1_dog", count=3)
    (dataset,) = kohya_datasets(_config(train_data_dir=str(tmp_path / "train"), reg_data_dir=str(tmp_path / "reg"),
                                       resolution="64,64", caption_extension=".txt"), "train sdxl-lora")
    train, reg = dataset.subsets
    assert (train.num_repeats, train.class_tokens, train.is_reg) == (10, "sks dog", False)
    assert (reg.num_repeats, reg.class_tokens, reg.is_reg) == (1, "dog", True)
    assert dataset.buckets.resolution == (64, 64)
    (tmp_path / "train" / "misnamed").mkdir()
    with pytest.raises(UserError, match="not named <repeats>_<class tokens>"):
        kohya_datasets(_config(train_data_dir=str(tmp_path / "train"), resolution="64"), "train sdxl-lora")


def test_in_json_makes_a_fine_tuning_dataset(tmp_path: Path) -> None:
    write_images(tmp_path / "train", count=2)
    (tmp_path / "meta.json").write_text('{"img0": {"caption": "a red dog"}, "img1": {"caption": "a blue cat"}}')
    datasets = kohya_datasets(_config(train_data_dir=str(tmp_path / "train"), in_json=str(tmp_path / "meta.json"),
                                     resolution="64"), "train sdxl-lora")
    assert datasets[0].method == "finetune"
    assert sorted(r.caption for r in build_dataset(datasets, seed=0).records) == ["a blue cat", "a red dog"]


def test_sample_prompt_lines_take_sd_scripts_options() -> None:
    sample = parse_sample_prompt("a cat, red --n low quality --w 512 --h 768 --s 20 --l 6.5 --d 42 --ss euler",
                                 "p.txt:1", (1024, 1024))
    assert (sample.prompt, sample.negative_prompt, sample.width, sample.height) == ("a cat, red", "low quality",
                                                                                   512, 768)
    assert (sample.steps, sample.scale, sample.seed, sample.sampler) == (20, 6.5, 42, "euler")
    assert parse_sample_prompt("plain", "p.txt:2", (64, 32)).width == 64
    with pytest.raises(UserError, match=r"p.txt:3: unknown prompt option '--x'"):
        parse_sample_prompt("a cat --x 3", "p.txt:3", (64, 64))
    with pytest.raises(UserError, match=r"p.txt:4: --ss: unknown sampler 'eular' \(did you mean 'euler'\?\)"):
        parse_sample_prompt("a cat --ss eular", "p.txt:4", (64, 64))


def _fails(capsys, *args: object) -> str:
    code = run_cli("train", "sdxl-lora", *args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_unknown_optimizer_is_named_with_a_suggestion(tiny_sdxl_dir: Path, tmp_path: Path, capsys) -> None:
    err = _fails(capsys, "--pretrained_model_name_or_path", tiny_sdxl_dir, "--output_dir", tmp_path / "o",
                 "--dataset_config", write_method(tmp_path, "class_tokens"), "--optimizer_type", "AdamW9bit")
    assert "--optimizer_type" in err and "did you mean 'AdamW8bit'" in err


def test_corrupt_image_is_named(tiny_sdxl_dir: Path, tmp_path: Path, capsys) -> None:
    toml = write_method(tmp_path, "class_tokens")
    (tmp_path / "butterfly" / "img1.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    err = _fails(capsys, "--pretrained_model_name_or_path", tiny_sdxl_dir, "--output_dir", tmp_path / "o",
                 "--dataset_config", toml)
    assert "img1.png" in err
    assert not (tmp_path / "o").exists()


def test_missing_caption_file_is_named(tiny_sdxl_dir: Path, tmp_path: Path, capsys) -> None:
    toml = write_method(tmp_path, "captions")
    (tmp_path / "butterfly" / "img2.txt").unlink()
    err = _fails(capsys, "--pretrained_model_name_or_path", tiny_sdxl_dir, "--output_dir", tmp_path / "o",
                 "--dataset_config", toml)
    assert "img2.txt" in err and "caption file not found" in err


@pytest.mark.parametrize("line, expected", [
    ("num_repeat = 3", "datasets[0].subsets[0]: unknown key 'num_repeat' (did you mean 'num_repeats'?)"),
    ("batch_size = 3", "datasets[0].subsets[0]: key 'batch_size' belongs in [[datasets]] or [general]"),
    ("metadata_file = 'm.json'", "subsets[0] has metadata_file (fine-tuning) but subsets[1] has none"),
])
def test_dataset_toml_errors_name_the_place_and_key(line: str, expected: str, tiny_sdxl_dir: Path, tmp_path: Path,
                                                     capsys) -> None:
    toml = write_method(tmp_path, "class_tokens")
    text = toml.read_text().replace("num_repeats = 2\n", f"num_repeats = 2\n{line}\n")
    if line.startswith("metadata_file"):
        butterfly = (tmp_path / "butterfly").as_posix()
        text += f"\n  [[datasets.subsets]]\n  image_dir = '{butterfly}'\n  class_tokens = 'x'\n"
    toml.write_text(text)
    err = _fails(capsys, "--pretrained_model_name_or_path", tiny_sdxl_dir, "--output_dir", tmp_path / "o",
                 "--dataset_config", toml)
    assert str(toml) in err and expected in err


def test_unknown_key_in_the_training_config(tmp_path: Path, capsys) -> None:
    config = tmp_path / "train.toml"
    config.write_text("network_dmi = 8\n")
    err = _fails(capsys, "--config", config)
    assert "unknown key 'network_dmi'" in err and "did you mean 'network_dim'" in err


def test_other_bad_flags(tiny_sdxl_dir: Path, tmp_path: Path, capsys) -> None:
    toml = write_method(tmp_path, "class_tokens")
    base = ("--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config", toml)
    assert "networks.lora" in _fails(capsys, *base, "--output_dir", tmp_path / "a", "--network_module", "networks.oft")
    assert "--full_bf16 needs --mixed_precision bf16" in _fails(capsys, *base, "--output_dir", tmp_path / "b",
                                                                "--full_bf16")
    assert "did you mean 'conv_dim'" in _fails(capsys, *base, "--output_dir", tmp_path / "c", "--network_args",
                                               "conv_dims=4")
    missing = _fails(capsys, "--pretrained_model_name_or_path", tmp_path / "nope.safetensors", "--dataset_config",
                     toml, "--output_dir", tmp_path / "d")
    assert "nope.safetensors" in missing


def test_a_lone_single_file_offline_names_the_model_config_flag(tiny_sdxl_single_file: Path, tmp_path: Path,
                                                                capsys) -> None:
    """No model_index.json beside the file: its configs come from the hub's SDXL base, out of reach offline."""
    lone = tmp_path / "model" / "sd_xl_base_1.0.safetensors"
    lone.parent.mkdir()
    shutil.copy(tiny_sdxl_single_file, lone)
    err = _fails(capsys, "--pretrained_model_name_or_path", lone, "--output_dir", tmp_path / "o",
                 "--dataset_config", write_method(tmp_path, "class_tokens"))
    assert err.startswith(f"error: --pretrained_model_name_or_path: {lone} is a lone single file")
    assert "give --model_config a diffusers SDXL folder" in err
    assert not (tmp_path / "o").exists()
