"""The Kohya dataset TOML: strict keys with places and suggestions, precedence, method detection."""

from pathlib import Path

import pytest

from dreamstep.data.dataset_config import KEYS, load_dataset_config, parse_dataset_config, require_methods
from dreamstep.errors import UserError


def parse(data, cli=None):
    return parse_dataset_config(data, "d.toml", cli)


def db(**subset):
    return {"datasets": [{"resolution": 512, "subsets": [{"image_dir": "imgs", **subset}]}]}


def test_unknown_key_names_place_and_suggestion():
    data = {"datasets": [{"resolution": 512, "subsets": [{"image_dir": "a"}, {"image_dir": "b", "num_repeat": 3}]}]}
    with pytest.raises(UserError) as e:
        parse(data)
    assert str(e.value) == ("d.toml: datasets[0].subsets[1]: unknown key 'num_repeat' "
                            "(did you mean 'num_repeats'?)")


def test_unknown_key_in_general_and_dataset():
    with pytest.raises(UserError, match=r"d.toml: \[general\]: unknown key 'enable_buckets' "
                                        r"\(did you mean 'enable_bucket'\?\)"):
        parse({"general": {"enable_buckets": True}, **db()})
    with pytest.raises(UserError, match=r"datasets\[0\]: unknown key 'resolutoin' \(did you mean 'resolution'\?\)"):
        parse({"datasets": [{"resolutoin": 512, "subsets": [{"image_dir": "a"}]}]})
    with pytest.raises(UserError, match="top level: unknown key 'dataset'"):
        parse({"dataset": []})


def test_keys_in_the_wrong_place():
    with pytest.raises(UserError, match=r"datasets\[0\].subsets\[0\]: key 'batch_size' belongs in \[\[datasets\]\]"):
        parse(db(batch_size=2))
    with pytest.raises(UserError, match=r"\[general\]: key 'image_dir' belongs in a \[\[datasets.subsets\]\]"):
        parse({"general": {"image_dir": "x"}, **db()})
    with pytest.raises(UserError, match="'color_aug' is an sd-scripts option dreamstep does not support"):
        parse(db(color_aug=True))


def test_bad_type_names_key():
    with pytest.raises(UserError, match=r"datasets\[0\].subsets\[0\]: key 'num_repeats': '2.5' is not an integer"):
        parse(db(num_repeats=2.5))
    with pytest.raises(UserError, match="caption_dropout_rate: must be between 0 and 1"):
        parse(db(caption_dropout_rate=1.5))


def test_mixed_dreambooth_and_finetuning_is_an_error():
    data = {"datasets": [{"resolution": 512, "subsets": [{"image_dir": "a"}, {"metadata_file": "m.json"}]}]}
    with pytest.raises(UserError, match=r"datasets\[0\]: subsets\[1\] has metadata_file \(fine-tuning\) but "
                                        r"subsets\[0\] has none \(DreamBooth\)"):
        parse(data)
    data = {"datasets": [{"resolution": 512, "subsets": [{"image_dir": "a", "conditioning_data_dir": "c"},
                                                         {"image_dir": "b"}]}]}
    with pytest.raises(UserError, match=r"subsets\[0\] has conditioning_data_dir \(ControlNet\) but subsets\[1\]"):
        parse(data)


def test_method_detection_and_method_specific_keys():
    assert parse(db())[0].method == "dreambooth"
    ft = {"datasets": [{"resolution": 512, "subsets": [{"metadata_file": "m.json"}]}]}
    assert parse(ft)[0].method == "finetune"
    cn = {"datasets": [{"resolution": 512, "subsets": [{"image_dir": "a", "conditioning_data_dir": "c"}]}]}
    assert parse(cn)[0].method == "controlnet"
    ft["datasets"][0]["subsets"][0]["is_reg"] = True
    with pytest.raises(UserError, match="key 'is_reg' is not used by fine-tuning datasets"):
        parse(ft)
    with pytest.raises(UserError, match="needs ControlNet datasets; give every subset conditioning_data_dir"):
        require_methods(parse(db()), ("controlnet",), "flux-controlnet")


def test_resolution_required_for_dreambooth():
    with pytest.raises(UserError, match=r"d.toml: datasets\[0\]: 'resolution' is required"):
        parse({"datasets": [{"subsets": [{"image_dir": "a"}]}]})


def test_image_dir_required():
    with pytest.raises(UserError, match=r"datasets\[0\].subsets\[0\]: 'image_dir' is required"):
        parse({"datasets": [{"resolution": 512, "subsets": [{"class_tokens": "sks dog"}]}]})


def test_precedence_subset_dataset_general_cli():
    data = {
        "general": {"num_repeats": 2, "keep_tokens": 3, "shuffle_caption": True},
        "datasets": [{"resolution": [768, 512], "num_repeats": 5, "subsets": [
            {"image_dir": "a", "num_repeats": 7},
            {"image_dir": "b"},
        ]}, {"subsets": [{"image_dir": "c"}]}],
    }
    cli = {"num_repeats": 11, "keep_tokens": 1, "caption_extension": ".txt", "resolution": "640,320",
           "train_batch_size": 4, "flip_aug": None}
    first, second = parse(data, cli)
    assert [s.num_repeats for s in first.subsets] == [7, 5]  # subset > dataset
    assert second.subsets[0].num_repeats == 2  # general > command line
    assert first.subsets[0].captions.keep_tokens == 3 and first.subsets[0].captions.shuffle_caption
    assert first.subsets[0].caption_extension == ".txt"  # command line > default
    assert first.buckets.resolution == (768, 512) and second.buckets.resolution == (640, 320)
    assert first.batch_size == 4  # --train_batch_size is Kohya's name for batch_size
    assert first.subsets[0].flip_aug is False  # a flag left unset (None) is not a value
    assert parse(db())[0].subsets[0].caption_extension == ".caption"


def test_load_from_file(tmp_path: Path):
    path = tmp_path / "dataset.toml"
    path.write_text("[general]\nenable_bucket = true\n[[datasets]]\nresolution = 1024\nbatch_size = 2\n"
                    "  [[datasets.subsets]]\n  image_dir = 'x'\n  class_tokens = 'sks dog'\n"
                    "  caption_extension = 'txt'\n")
    (config,) = load_dataset_config(path)
    assert config.buckets.enable_bucket and config.batch_size == 2
    assert config.subsets[0].class_tokens == "sks dog" and config.subsets[0].caption_extension == ".txt"
    assert config.where == f"{path}: datasets[0]"
    path.write_text("[[datasets]\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_dataset_config(path)


TYPED_KEYS = [(key, spec) for key, spec in KEYS.items() if spec.type in (bool, int, float)]


@pytest.mark.parametrize("key, text", [(key, "yes" if spec.type is bool else "10") for key, spec in TYPED_KEYS])
def test_a_quoted_boolean_or_number_is_refused_naming_the_key(key, text):
    """`enable_bucket = "yes"` used to be read as true, and the error then blamed min_bucket_reso."""
    table = {"general": {key: text}} if KEYS[key].level != "subset_only" else {}
    data = {**table, **db(**({key: text} if KEYS[key].level == "subset_only" else {}))}
    with pytest.raises(UserError, match=f"key '{key}': \"{text}\" is a string; write .* without quotes"):
        parse(data)
