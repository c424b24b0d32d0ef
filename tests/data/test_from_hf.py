"""``dreamstep dataset from-hf``: Hugging Face datasets written by ``datasets`` itself (parquet, save_to_disk,
JSON lines with image paths) become images + metadata.json that the fine-tuning dataset reads; an
interrupted run continues to the same result; bad input gets one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dreamstep.cli import main
from dreamstep.config.schema import build_config
from dreamstep.config.sdxl_lora import SDXLLoraConfig
from dreamstep.data import build_dataset, load_dataset_config
from dreamstep.data.from_hf import METADATA_NAME, TOML_NAME
from dreamstep.data.sources import kohya_datasets

datasets = pytest.importorskip("datasets")


def _image(i: int, fmt: str = "PNG") -> Image.Image:
    pixels = np.random.default_rng(i).integers(0, 255, (48, 64 + 16 * (i % 2), 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return Image.open(io.BytesIO(buffer.getvalue()))  # keeps .format, so datasets stores these bytes


def _dataset(n: int, image: str = "image", caption: str = "text", **extra: list) -> datasets.Dataset:
    rows = {image: [_image(i, "JPEG" if i % 3 == 2 else "PNG") for i in range(n)],
            caption: [f"a photo of thing {i}" for i in range(n)], **extra}
    features = datasets.Features({image: datasets.Image(), caption: datasets.Value("string"),
                                  **{k: datasets.Value("string") for k in extra}})
    return datasets.Dataset.from_dict(rows, features=features)


def _run(*args: object) -> int:
    return main(["dataset", "from-hf", *(str(a) for a in args)])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


def test_parquet_becomes_a_finetune_dataset(tmp_path: Path, capsys) -> None:
    _dataset(5).to_parquet(tmp_path / "train.parquet")
    out = tmp_path / 'out "🐱" \\ set'  # its path is written into the dataset TOML
    assert _run(tmp_path / "train.parquet", out, "--resolution", "256") == 0
    assert f"wrote 5 images to {out}" in capsys.readouterr().out
    names = ["000000.png", "000001.png", "000002.jpg", "000003.png", "000004.png"]
    assert sorted(p.name for p in out.glob("0*")) == names
    metadata = json.loads((out / METADATA_NAME).read_text(encoding="utf-8"))
    assert metadata == {name: {"caption": f"a photo of thing {i}"} for i, name in enumerate(names)}
    # The JPEG keeps its bytes (no second lossy encoding).
    assert Image.open(out / "000002.jpg").format == "JPEG"
    configs = load_dataset_config(out / TOML_NAME)
    assert configs[0].method == "finetune"
    records = build_dataset(configs, seed=0).records
    assert sorted((r.image.path.name, r.caption) for r in records) == [
        (name, f"a photo of thing {i}") for i, name in enumerate(names)]


@pytest.mark.parametrize("resolution", [64, 256, 1024, 2048])
def test_the_written_toml_is_accepted_by_the_trainer_at_any_resolution(tmp_path: Path, resolution: int) -> None:
    """At 64 px the TOML used to keep sd-scripts' default min_bucket_reso 256, which its own trainer refused."""
    _dataset(2).to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "out"
    assert _run(tmp_path / "train.parquet", out, "--resolution", resolution) == 0
    config = build_config(SDXLLoraConfig, {"pretrained_model_name_or_path": "unused", "output_dir": "unused",
                                           "dataset_config": str(out / TOML_NAME)})
    (dataset,) = kohya_datasets(config, "train sdxl-lora")
    assert dataset.buckets.resolution == (resolution, resolution)
    assert len(build_dataset([dataset], seed=0).records) == 2


def test_saved_dataset_dict_with_chosen_split_and_columns(tmp_path: Path, capsys) -> None:
    test = _dataset(4, image="picture", caption="blip", prompt=["p0", "", "p2", "p3"])
    garbage = datasets.Dataset.from_dict({"picture": [{"bytes": b"not an image", "path": None}], "blip": ["x"],
                                          "prompt": ["p4"]}, features=test.features)
    datasets.DatasetDict(train=_dataset(2), test=datasets.concatenate_datasets([test, garbage])).save_to_disk(
        tmp_path / "saved")
    out = tmp_path / "out"
    assert _run(tmp_path / "saved", out, "--split", "test", "--caption_column", "prompt") == 0
    printed = capsys.readouterr().out
    assert "wrote 3 images" in printed
    assert "left out 1 rows with an empty caption (rows 1)" in printed
    assert "left out row 4: unreadable image" in printed
    metadata = json.loads((out / METADATA_NAME).read_text(encoding="utf-8"))
    assert metadata == {"000000.png": {"caption": "p0"}, "000002.jpg": {"caption": "p2"},
                        "000003.png": {"caption": "p3"}}


def test_json_lines_with_image_paths(tmp_path: Path) -> None:
    (tmp_path / "pics").mkdir()
    lines = []
    for i in range(3):
        _image(i).save(tmp_path / "pics" / f"{i}.png")
        lines.append(json.dumps({"file_name": f"pics/{i}.png", "caption": [f"caption {i}", "second"]}))
    (tmp_path / "rows.jsonl").write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "out"
    assert _run(tmp_path / "rows.jsonl", out, "--image_column", "file_name") == 0
    assert (out / "000001.png").read_bytes() == (tmp_path / "pics" / "1.png").read_bytes()
    assert json.loads((out / METADATA_NAME).read_text())["000002.png"] == {"caption": "caption 2"}


def test_an_interrupted_run_continues_to_the_same_result(tmp_path: Path, capsys) -> None:
    _dataset(6).to_parquet(tmp_path / "data.parquet")
    assert _run(tmp_path / "data.parquet", tmp_path / "clean") == 0
    out = tmp_path / "resumed"
    assert _run(tmp_path / "data.parquet", out, "--limit", "3") == 0  # stops after 3 rows
    assert len(json.loads((out / METADATA_NAME).read_text())) == 3
    (out / "000001.png").unlink()  # lost
    (out / ".part-000003.png").write_bytes(b"half a fi")  # a write cut short
    capsys.readouterr()
    assert _run(tmp_path / "data.parquet", out) == 0
    assert f"wrote 4 images to {out} (2 already there from an earlier run)" in capsys.readouterr().out
    assert _snapshot(out) == _snapshot(tmp_path / "clean") | {TOML_NAME: (out / TOML_NAME).read_bytes()}


@pytest.mark.parametrize("args, expected", [
    (("{tmp}/missing.parquet", "{tmp}/out"), "no such file or folder"),
    (("someone/captioned-photos", "{tmp}/out"), "a hub name needs a network"),  # tests run offline
    (("{tmp}/data.parquet", "{tmp}/out", "--image_column", "imag"),
     ("--image_column imag: {tmp}/data.parquet has no such column (did you mean 'image'?); its columns: "
      "image (image), text (text), note (text)")),
    (("{tmp}/data.parquet", "{tmp}/out", "--caption_column", "txt"), "(did you mean 'text'?)"),
    (("{tmp}/data.parquet", "{tmp}/out", "--image_column", "note"), "--image_column note: row 0 holds no image"),
    (("{tmp}/data.parquet", "{tmp}/out", "--split", "test"), "has no such split; choose one of train"),
    (("{tmp}/data.parquet", "{tmp}/foreign"), "is not empty and was not made by 'dataset from-hf'"),
    (("{tmp}/data.parquet", "{tmp}/done", "--caption_column", "note"), "was made with caption_column = 'text'"),
    (("{tmp}/data.parquet", "{tmp}/out", "--limit", "0"), "--limit must be at least 1"),
])
def test_bad_input_is_one_line(tmp_path: Path, capsys, args: tuple[str, ...], expected: str) -> None:
    _dataset(2, note=["a", "b"]).to_parquet(tmp_path / "data.parquet")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "mine.txt").write_text("keep me")
    assert _run(tmp_path / "data.parquet", tmp_path / "done") == 0
    capsys.readouterr()
    assert _run(*(a.format(tmp=tmp_path) for a in args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert expected.format(tmp=tmp_path) in line
    assert (tmp_path / "foreign" / "mine.txt").read_text() == "keep me"
