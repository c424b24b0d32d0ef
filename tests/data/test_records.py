"""From configs to validated records: the three Kohya methods, regularization balance, ControlNet pairs,
and errors that name the file."""

import json
from pathlib import Path

import pytest
from data_testkit import write_image

from dreamstep.data.dataset_config import parse_dataset_config
from dreamstep.data.records import balance_regularization, collect_records
from dreamstep.data.sources import controlnet_from_flags, dreambooth_from_flags
from dreamstep.errors import UserError


def records_of(data):
    (config,) = parse_dataset_config(data, "d.toml")
    return collect_records(config)


def dataset(*subsets, **dataset_keys):
    return {"datasets": [{"resolution": 64, **dataset_keys, "subsets": list(subsets)}]}


def captions(records):
    return {r.image.path.name: r.caption for r in records}


def test_class_identifier_method(image_folder):
    folder = image_folder("dog", {"a.png": (64, 64), "b.jpg": (80, 64)})
    records = records_of(dataset({"image_dir": str(folder), "class_tokens": "sks dog"}))
    assert captions(records) == {"a.png": "sks dog", "b.jpg": "sks dog"}


def test_caption_method_reads_first_line(image_folder):
    folder = image_folder("dog", {"a.png": (64, 64), "b.png": (64, 64)},
                          captions={"a": "a photo of sks dog\nsecond line", "b": "  sks dog on grass  "},
                          extension=".txt")
    records = records_of(dataset({"image_dir": str(folder), "caption_extension": ".txt"}))
    assert captions(records) == {"a.png": "a photo of sks dog", "b.png": "sks dog on grass"}


def test_caption_file_wins_over_class_tokens(image_folder):
    folder = image_folder("dog", {"a.png": (64, 64), "b.png": (64, 64)}, captions={"a": "own caption"})
    records = records_of(dataset({"image_dir": str(folder), "class_tokens": "sks dog"}))
    assert captions(records) == {"a.png": "own caption", "b.png": "sks dog"}


def test_missing_caption_file_when_required(image_folder):
    folder = image_folder("dog", {"a.png": (64, 64), "b.png": (64, 64)}, captions={"a": "x"})
    with pytest.raises(UserError) as e:
        records_of(dataset({"image_dir": str(folder)}))
    assert str(e.value) == (f"{folder / 'b.caption'}: caption file not found for b.png; write it, or set "
                            "class_tokens for d.toml: datasets[0].subsets[0]")


def test_a_missing_caption_names_the_flag_that_sets_a_fallback(image_folder):
    """Each source has its own way to give images without a caption file their caption."""
    folder = image_folder("dog", {"a.png": (64, 64)})
    with pytest.raises(UserError, match=r"caption file not found for a\.png; write it, or set --default_caption "
                                        r"for --train_data_dir$"):
        collect_records(controlnet_from_flags(train_data_dir=folder, conditioning_data_dir=folder))
    with pytest.raises(UserError, match=r"caption file not found for a\.png; write it, or set --instance_prompt "
                                        r"for --instance_data_dir$"):
        collect_records(dreambooth_from_flags(folder, None, caption_extension=".txt"))


def test_finetuning_json(image_folder, tmp_path: Path):
    folder = image_folder("ft", {"img0.png": (64, 64), "img1.jpg": (64, 64)})
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"img0": {"caption": "a green pokemon\nmore", "tags": "cute, small"},
                                "img1": {"tags": "red, ball"}}))
    records = records_of(dataset({"image_dir": str(folder), "metadata_file": str(meta)}))
    assert captions(records) == {"img0.png": "a green pokemon, cute, small", "img1.jpg": "red, ball"}


def test_finetuning_jsonl(image_folder, tmp_path: Path):
    image_folder("ft", {"img0.png": (64, 64), "img1.png": (64, 64)})
    meta = tmp_path / "meta.jsonl"
    meta.write_text('{"file_name": "ft/img0.png", "text": "first"}\n\n{"image": "ft/img1.png", "caption": "second"}\n')
    records = records_of(dataset({"metadata_file": str(meta)}))
    assert captions(records) == {"img0.png": "first", "img1.png": "second"}


def test_finetuning_missing_image_named(tmp_path: Path):
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"ghost": {"caption": "x"}}))
    with pytest.raises(UserError, match=rf"{meta}: entry 'ghost': image not found"):
        records_of(dataset({"metadata_file": str(meta)}))


@pytest.mark.parametrize("train, reg, expected", [
    (6, [1, 1, 1, 1], [2, 2, 1, 1]),  # one pass gives 4; then one more repeat each, round robin, until 6
    (6, [1] * 10, [1] * 6 + [0] * 4),  # more than enough: the rest is left out
    (5, [3, 3], [3, 3]),  # the first pass registers each image with its own repeats
    (0, [1, 1], [0, 0]),
])
def test_balance_regularization(train, reg, expected):
    assert balance_regularization(train, reg) == expected


def test_regularization_subset_balanced(image_folder):
    train = image_folder("train", {f"t{i}.png": (64, 64) for i in range(3)})
    reg = image_folder("reg", {f"r{i}.png": (64, 64) for i in range(4)})
    records = records_of(dataset({"image_dir": str(train), "class_tokens": "sks dog", "num_repeats": 2},
                                 {"image_dir": str(reg), "class_tokens": "dog", "is_reg": True}))
    reg_repeats = [r.num_repeats for r in records if r.subset.is_reg]
    assert reg_repeats == [2, 2, 1, 1]
    assert sum(r.num_repeats for r in records if not r.subset.is_reg) == 6


def test_corrupt_image_in_dataset_stops_before_training(image_folder):
    folder = image_folder("dog", {"a.png": (64, 64)})
    (folder / "b.jpg").write_bytes(b"\xff\xd8\xff\xe0 garbage")
    with pytest.raises(UserError, match=rf"^{folder / 'b.jpg'}: cannot read image"):
        records_of(dataset({"image_dir": str(folder), "class_tokens": "x"}))


def test_missing_image_dir_named(tmp_path: Path):
    with pytest.raises(UserError, match=r"d.toml: datasets\[0\].subsets\[0\]: folder '.*nope' does not exist"):
        records_of(dataset({"image_dir": str(tmp_path / "nope"), "class_tokens": "x"}))


def test_dreambooth_flags_map_to_instance_and_class_subsets(image_folder):
    instance = image_folder("inst", {"a.png": (64, 64), "b.png": (64, 64)}, captions={"a": "own"}, extension=".txt")
    klass = image_folder("class", {f"c{i}.png": (64, 64) for i in range(5)})
    config = dreambooth_from_flags(instance, "sks dog", caption_extension="txt", class_data_dir=klass,
                                   class_prompt="a dog", repeats=2, random_flip=True)
    records = collect_records(config)
    # Prior preservation from flags pairs class samples with instance samples (diffusers): every class image is used.
    assert captions(records) == {"a.png": "own", "b.png": "sks dog", **{f"c{i}.png": "a dog" for i in range(5)}}
    assert records[0].subset.flip_aug and records[0].subset.random_crop
    with pytest.raises(UserError, match="--class_prompt is required"):
        dreambooth_from_flags(instance, "sks dog", class_data_dir=klass)
    with pytest.raises(UserError, match="--instance_data_dir: folder"):
        dreambooth_from_flags(instance / "missing", "sks dog")


def test_controlnet_folder_pairs(image_folder):
    images = image_folder("img", {"a.png": (64, 64), "b.jpg": (96, 64)}, captions={"a": "cap a"}, extension=".txt")
    cond = image_folder("cond", {"a.png": (64, 64), "b.png": (48, 32)})
    config = controlnet_from_flags(train_data_dir=images, conditioning_data_dir=cond, default_caption="fallback")
    records = collect_records(config)
    assert {r.image.path.name: r.conditioning.path.name for r in records} == {"a.png": "a.png", "b.jpg": "b.png"}
    assert captions(records) == {"a.png": "cap a", "b.jpg": "fallback"}


def test_controlnet_missing_or_extra_partner_named(image_folder, tmp_path: Path):
    images = image_folder("img", {"a.png": (64, 64), "b.png": (64, 64)})
    cond = image_folder("cond", {"a.png": (64, 64), "z.png": (64, 64)})
    with pytest.raises(UserError, match=rf"^{images / 'b.png'}: no conditioning image named 'b.\*' in {cond}"):
        collect_records(controlnet_from_flags(train_data_dir=images, conditioning_data_dir=cond, default_caption="x"))
    write_image(cond / "b.png", (64, 64))
    with pytest.raises(UserError, match=rf"^{cond / 'z.png'}: conditioning image has no training image"):
        collect_records(controlnet_from_flags(train_data_dir=images, conditioning_data_dir=cond, default_caption="x"))
    with pytest.raises(UserError, match="--conditioning_data_dir: folder"):
        controlnet_from_flags(train_data_dir=images, conditioning_data_dir=tmp_path / "none")


def test_controlnet_jsonl(tmp_path: Path):
    root = tmp_path / "cn"
    write_image(root / "i.png", (64, 64))
    write_image(root / "c.png", (64, 64))
    (root / "metadata.jsonl").write_text(json.dumps({"image": "i.png", "conditioning_image": "c.png",
                                                     "text": "a cat"}) + "\n")
    (record,) = collect_records(controlnet_from_flags(train_data_dir=root))
    assert record.caption == "a cat" and record.conditioning.path == root / "c.png"


def test_controlnet_toml(image_folder):
    images = image_folder("img", {"a.png": (64, 64)}, captions={"a": "cap"})
    cond = image_folder("cond", {"a.png": (64, 64)})
    (record,) = records_of(dataset({"image_dir": str(images), "conditioning_data_dir": str(cond)}))
    assert record.caption == "cap" and record.conditioning.path == cond / "a.png"


def test_only_regularization_images_names_the_file_and_is_reg(image_folder):
    folder = image_folder("reg", {"a.png": (64, 64)})
    reg = {"image_dir": str(folder), "class_tokens": "dog", "is_reg": True}
    with pytest.raises(UserError, match=r"^d.toml: datasets\[0\]: every subset has is_reg = true.*is_reg = false"):
        records_of(dataset(reg, reg))


def test_regularization_is_balanced_against_the_images_left_to_train_on(image_folder):
    """sd-scripts balances class images to the training images; held-out ones are not trained on."""
    from dreamstep.data.holdout import build_split_datasets

    train = image_folder("dog", {f"{i}.png": (64, 64) for i in range(4)})
    reg = image_folder("reg", {f"{i}.png": (64, 64) for i in range(8)})
    held = image_folder("held", {f"{i}.png": (64, 64) for i in range(2)})
    (config,) = parse_dataset_config(dataset({"image_dir": str(train), "class_tokens": "sks dog"},
                                             {"image_dir": str(reg), "class_tokens": "dog", "is_reg": True},
                                             {"image_dir": str(held), "class_tokens": "sks dog",
                                              "is_validation": True}), "d.toml")
    whole, _ = build_split_datasets([config], seed=0)
    assert sum(r.num_repeats for r in whole.records if r.subset.is_reg) == 4  # the 2 validation images not counted
    split, held_out = build_split_datasets([config], seed=0, validation_split=0.5)
    trained = [r for r in split.records if not r.subset.is_reg]
    assert len(trained) == 2 and len(held_out.records) == 4
    assert sum(r.num_repeats for r in split.records if r.subset.is_reg) == 2
