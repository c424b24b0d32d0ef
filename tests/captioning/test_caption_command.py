"""``dreamstep caption`` end to end on tiny random captioners, loaded by the code that loads the real ones."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from dreamstep.captioning.tiny import TINY_TAGS
from dreamstep.cli import main
from dreamstep.data.dataset_config import SubsetConfig
from dreamstep.data.records import folder_caption, subset_entries

TAG_NAMES = {name.replace("_", " ") if len(name) > 3 else name for name, _ in TINY_TAGS}


def _pictures(folder: Path, names=("red.png", "blue.jpg", "green.webp")) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    colours = [(220, 30, 30), (30, 40, 210), (40, 200, 60), (240, 240, 240)]
    paths = []
    for i, name in enumerate(names):
        path = folder / name
        Image.new("RGB", (48 + 8 * i, 40), colours[i % len(colours)]).save(path)
        paths.append(path)
    return paths


def _caption(*args: str | Path) -> int:
    return main(["caption", *map(str, args)])


def _wd14(tiny_captioners: Path, folder: Path, *extra: str) -> int:
    return _caption(folder, "--captioner", "wd14", "--model", tiny_captioners / "wd14", "--batch_size", "2", *extra)


def test_tags_are_written_beside_each_image_and_a_corrupt_image_is_listed_once(tiny_captioners, tmp_path, capsys):
    images = _pictures(tmp_path / "data")
    (tmp_path / "data" / "broken.jpg").write_bytes(b"not a jpeg")
    (tmp_path / "data" / "photo.heic").write_bytes(b"\0")
    assert _wd14(tiny_captioners, tmp_path / "data") == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'data' / 'photo.heic'}: not an image type dreamstep reads (.heic)" in out
    for image in images:
        tags = [t.strip() for t in image.with_suffix(".txt").read_text().split(",")]
        assert tags and set(tags) <= TAG_NAMES
    assert not (tmp_path / "data" / "broken.txt").exists()
    assert out.count("broken.jpg") == 1 and "skipped 1 unreadable image" in out
    assert f"wrote 3 captions in {tmp_path / 'data'} (.txt files) (" in out and " images/s)" in out


def test_an_existing_caption_is_never_overwritten_and_a_second_run_resumes(tiny_captioners, tmp_path, capsys):
    first, second, third = _pictures(tmp_path / "data")
    first.with_suffix(".txt").write_text("my own words\n")
    assert _wd14(tiny_captioners, tmp_path / "data") == 0
    assert first.with_suffix(".txt").read_text() == "my own words\n"
    assert "2 images to caption, 1 already captioned" in capsys.readouterr().out
    # An interrupted run: one caption lost. The next run captions that image only and touches nothing else.
    third.with_suffix(".txt").unlink()
    before = {p: p.stat().st_mtime_ns for p in (first.with_suffix(".txt"), second.with_suffix(".txt"))}
    assert _wd14(tiny_captioners, tmp_path / "data") == 0
    assert "1 images to caption, 2 already captioned" in capsys.readouterr().out
    assert third.with_suffix(".txt").is_file()
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert _wd14(tiny_captioners, tmp_path / "data") == 0
    assert "nothing to do" in capsys.readouterr().out


def test_overwrite_append_and_prefix(tiny_captioners, tmp_path):
    (image,) = _pictures(tmp_path / "data", names=("red.png",))
    caption_file = image.with_suffix(".txt")
    caption_file.write_text("old words\n")
    assert _wd14(tiny_captioners, tmp_path / "data", "--overwrite", "--prefix", "sks dog, ") == 0
    fresh = caption_file.read_text().strip()
    assert fresh.startswith("sks dog, ") and "old words" not in fresh
    caption_file.write_text("painting, 1girl\n")
    assert _wd14(tiny_captioners, tmp_path / "data", "--append") == 0
    tags = [t.strip() for t in caption_file.read_text().split(",")]
    assert tags[:2] == ["painting", "1girl"] and tags.count("1girl") == 1
    assert set(tags[2:]) <= TAG_NAMES - {"1girl"}


def test_dry_run_prints_captions_and_writes_nothing(tiny_captioners, tmp_path, capsys):
    images = _pictures(tmp_path / "data")
    assert _wd14(tiny_captioners, tmp_path / "data", "--dry_run") == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(p.name for p in images)
    assert all(f"{image}: " in captured.out + captured.err for image in images)
    assert "dry run: would write 3 captions" in captured.out


def test_metadata_jsonl_is_what_the_trainer_reads(tiny_captioners, tmp_path):
    images = _pictures(tmp_path / "data")
    metadata = tmp_path / "data" / "metadata.jsonl"
    metadata.write_text(json.dumps({"file_name": "red.png", "text": "a red square", "source": "me"}) + "\n")
    assert _wd14(tiny_captioners, tmp_path / "data", "--metadata_jsonl") == 0
    rows = [json.loads(line) for line in metadata.read_text().splitlines()]
    assert rows[0] == {"file_name": "red.png", "text": "a red square", "source": "me"}
    assert [r["file_name"] for r in rows] == ["red.png", "blue.jpg", "green.webp"]
    subset = SubsetConfig(where="test", image_dir=tmp_path / "data", metadata_file=metadata, caption_extension=None)
    entries = {e.path.name: e.caption for e in subset_entries(subset, "finetune")}
    assert set(entries) == {p.name for p in images} and entries["red.png"] == "a red square"
    assert all(set(entries[p.name].split(", ")) <= TAG_NAMES for p in images[1:])


def test_a_dataset_toml_captions_each_subset_with_its_extension(tiny_captioners, tmp_path, capsys):
    _pictures(tmp_path / "people", names=("a.png", "b.png"))
    _pictures(tmp_path / "styles", names=("c.png",))
    _pictures(tmp_path / "dogs", names=("d.png",))
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "people"}"\n'
                    f'caption_extension = ".caption"\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "styles"}"\n'
                    f'caption_extension = "txt"\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "dogs"}"\n'
                    'is_reg = true\nclass_tokens = "dog"\n')
    assert _wd14(tiny_captioners, toml) == 0
    assert sorted(p.name for p in (tmp_path / "people").glob("*.caption")) == ["a.caption", "b.caption"]
    assert (tmp_path / "styles" / "c.txt").is_file()
    # Regularization images train with their class prompt; caption files would replace it.
    assert sorted(p.name for p in (tmp_path / "dogs").iterdir()) == ["d.png"]
    assert "regularization images, captioned by class_tokens 'dog'" in capsys.readouterr().out


def test_sd_scripts_repeat_folders_are_each_captioned(tiny_captioners, tmp_path):
    _pictures(tmp_path / "train" / "10_sks dog", names=("a.png",))
    _pictures(tmp_path / "train" / "1_dog", names=("b.png",))
    assert _wd14(tiny_captioners, tmp_path / "train") == 0
    assert (tmp_path / "train" / "10_sks dog" / "a.txt").is_file()
    assert (tmp_path / "train" / "1_dog" / "b.txt").is_file()


@pytest.mark.parametrize("captioner", ["florence2", "blip"])
def test_sentence_captioners_write_one_line_the_trainer_reads(captioner, tiny_captioners, tmp_path, capsys):
    images = _pictures(tmp_path / "data")
    assert _caption(tmp_path / "data", "--captioner", captioner, "--model", tiny_captioners / captioner,
                    "--max_new_tokens", "6", "--batch_size", "2", "--prefix", "sks, ") == 0
    assert f"{captioner} {tiny_captioners / captioner} on cpu (fp32)" in capsys.readouterr().out
    subset = SubsetConfig(where="test", image_dir=tmp_path / "data", caption_extension=".txt")
    for image in images:
        text = image.with_suffix(".txt").read_text(encoding="utf-8")
        assert text.endswith("\n") and text.count("\n") == 1
        assert folder_caption(image, subset) == text.strip() and text.startswith("sks, ") and len(text) > 6


def test_a_missing_model_offline_is_one_line_and_writes_nothing(tmp_path, capsys):
    _pictures(tmp_path / "data")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert _caption(tmp_path / "data", "--model", "nobody/no-such-captioner") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --model nobody/no-such-captioner: cannot load")
    assert not list((tmp_path / "data").glob("*.txt"))


def test_a_model_path_that_is_not_there_is_named_as_a_path_not_as_offline(tmp_path, capsys):
    _pictures(tmp_path / "data")
    missing = tmp_path / "models" / "blip"
    assert _caption(tmp_path / "data", "--captioner", "blip", "--model", missing) == 2
    err = capsys.readouterr().err
    assert err == f"error: --model {missing}: no such folder, and not a hub id (owner/name); check the path\n"
    assert not list((tmp_path / "data").glob("*.txt"))


def test_a_damaged_model_folder_is_named_as_damaged_not_as_offline(tmp_path, capsys):
    _pictures(tmp_path / "data")
    damaged = tmp_path / "florence"
    damaged.mkdir()
    (damaged / "config.json").write_text("{not json")
    assert _caption(tmp_path / "data", "--captioner", "florence2", "--model", damaged) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a valid JSON" in err and "download the folder again" in err
    assert "HF_HUB_OFFLINE" not in err
    assert not list((tmp_path / "data").glob("*.txt"))


def test_a_model_of_another_kind_is_refused(tiny_captioners, tmp_path, capsys):
    _pictures(tmp_path / "data")
    assert _caption(tmp_path / "data", "--captioner", "florence2", "--model", tiny_captioners / "blip") == 2
    assert "a 'blip' model, not a florence2 captioner" in capsys.readouterr().err


def test_a_model_folder_without_captioner_is_used_as_the_kind_it_is(tiny_captioners, tmp_path, capsys):
    from dreamstep.config.caption import detected_captioner

    kinds = {name: detected_captioner(str(tiny_captioners / name)) for name in
             ("florence2", "blip", "qwen2_5_vl", "llava", "wd14")}
    assert kinds == {"florence2": "florence2", "blip": "blip", "qwen2_5_vl": "qwen-vl", "llava": "llava",
                     "wd14": "wd14"}
    assert detected_captioner("owner/some-captioner") is None and detected_captioner(str(tmp_path)) is None
    images = _pictures(tmp_path / "data")
    assert _caption(tmp_path / "data", "--model", tiny_captioners / "wd14") == 0
    assert all(set(t.strip() for t in i.with_suffix(".txt").read_text().split(",")) <= TAG_NAMES for i in images)
    # An explicit --captioner still has to match, in one line (a tagger folder has no transformers config).
    assert _caption(tmp_path / "data", "--captioner", "florence2", "--model", tiny_captioners / "wd14",
                    "--overwrite") == 2
    assert capsys.readouterr().err.endswith("not a transformers florence2 model (no config.json with a model type "
                                            "there); give one like the default, or pick the matching --captioner\n")


def test_bad_flags_answer_before_anything_loads(tmp_path, capsys):
    assert _caption(tmp_path, "--overwrite", "--append") == 2
    assert _caption(tmp_path, "--captioner", "blip", "--prompt", "describe") == 2
    assert _caption(tmp_path / "missing") == 2
    err = capsys.readouterr().err
    assert "contradict" in err and "--prompt is used by --captioner qwen-vl or llava only" in err
    assert "no such folder" in err


def test_an_instruction_model_answers_the_prompt(tiny_captioners, tmp_path):
    """The qwen-vl path (chat template, left padding, the answer cut from the prompt) on a tiny LLaVA-layout
    model, whose processor needs no torchvision: another prompt gives other captions."""
    captions = {}
    for prompt in ("Describe the colours.", "What is the main subject?"):
        folder = tmp_path / prompt.split()[0]
        images = _pictures(folder)
        assert _caption(folder, "--captioner", "qwen-vl", "--model", tiny_captioners / "llava", "--prompt", prompt,
                        "--max_new_tokens", "6", "--batch_size", "2") == 0
        captions[prompt] = [image.with_suffix(".txt").read_text(encoding="utf-8") for image in images]
        assert all(text.strip() and "<|im_start|>" not in text and prompt not in text for text in captions[prompt])
    assert captions["Describe the colours."] != captions["What is the main subject?"]


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_qwen_vl_without_torchvision_says_what_to_install(tiny_captioners, tmp_path, capsys):
    _pictures(tmp_path / "data")
    assert _caption(tmp_path / "data", "--captioner", "qwen-vl", "--model", tiny_captioners / "qwen2_5_vl") == 2
    assert "needs torchvision" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="transformers' Qwen-VL processor "
                    "needs torchvision")
def test_qwen_vl_follows_the_prompt_path(tiny_captioners, tmp_path):
    images = _pictures(tmp_path / "data")
    assert _caption(tmp_path / "data", "--captioner", "qwen-vl", "--model", tiny_captioners / "qwen2_5_vl",
                    "--max_new_tokens", "6",
                    "--prompt", "Describe the colours.") == 0
    assert all(image.with_suffix(".txt").read_text().strip() for image in images)


@pytest.mark.parametrize("argv", [["--help"], ["data", "--batch_size", "0"], ["data", "--captioner", "git"]],
                         ids=["help", "bad-value", "bad-choice"])
def test_flags_are_checked_before_torch_loads(argv):
    code = ("import sys; from dreamstep.cli import main\n"
            "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, "caption", *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.splitlines()[-1] == f"{0 if argv == ['--help'] else 2} False", proc.stdout + proc.stderr


def test_every_flag_can_come_from_a_toml(tiny_captioners, tmp_path):
    (image,) = _pictures(tmp_path / "data", names=("red.png",))
    config = tmp_path / "caption.toml"
    config.write_text(f'source = "{tmp_path / "data"}"\ncaptioner = "wd14"\nmodel = "{tiny_captioners / "wd14"}"\n'
                      'caption_extension = ".caption"\nprefix = "sks, "\n')
    assert _caption("--config", config) == 0
    assert image.with_suffix(".caption").read_text().startswith("sks, ")


def test_a_model_with_its_own_code_is_refused_without_asking(tiny_captioners, tmp_path, capsys):
    """microsoft/Florence-2-* ship remote code: refused in one line, no interactive question, nothing run."""
    _pictures(tmp_path / "data")
    config = json.loads((tiny_captioners / "florence2" / "config.json").read_text())
    config.update(model_type="florence2_remote", auto_map={"AutoConfig": "configuration_florence2.Florence2Config"})
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "config.json").write_text(json.dumps(config))
    assert _caption(tmp_path / "data", "--model", tmp_path / "remote") == 2
    captured = capsys.readouterr()
    assert "ships its own code, which dreamstep does not run" in captured.err and "[y/N]" not in captured.out
