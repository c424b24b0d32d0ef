"""The dataset check: problems the trainer would stop at, all at once; buckets; captions as training sees
them (the trainer's own BucketDataset), train vs regularization subsets; and its page data over HTTP."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dreamstep.dashboard.dataset_check import check_dataset, summary
from dreamstep.data.dataset import build_dataset
from dreamstep.data.dataset_config import load_dataset_config
from dreamstep.data.holdout import build_split_datasets
from dreamstep.errors import UserError

CAPTION = "sks dog, red collar, sitting, grass, sunny"


def _image(path: Path, size: tuple[int, int], caption: str | None = CAPTION, ext: str = ".txt") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(path.name))
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    if caption is not None:
        path.with_suffix(ext).write_text(caption)


@pytest.fixture
def dataset_toml(tmp_path: Path) -> Path:
    train, reg = tmp_path / "train", tmp_path / "reg"
    for i, size in enumerate([(512, 512), (768, 512), (512, 768), (640, 640)]):
        _image(train / f"t{i}.png", size)
    for i in range(3):
        _image(reg / f"r{i}.png", (512, 512), caption=None)
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"""
[general]
enable_bucket = true
shuffle_caption = true
keep_tokens = 1
caption_extension = ".txt"

[[datasets]]
resolution = 512
batch_size = 2

  [[datasets.subsets]]
  image_dir = "{train}"
  num_repeats = 2

  [[datasets.subsets]]
  image_dir = "{reg}"
  is_reg = true
  class_tokens = "a dog"
""")
    return toml


def test_captions_are_what_the_trainer_feeds_and_reshuffle_per_epoch(dataset_toml):
    check = check_dataset(dataset_toml, seed=5)
    trainer = build_dataset(load_dataset_config(dataset_toml), seed=5)
    for epoch in (0, 1, 2):
        captions = check.captions(epoch)
        first = {}
        for index in range(len(trainer)):
            item = trainer[(index, epoch)]
            first.setdefault(item["image_path"], item["caption"])
        assert {str(check.images[n].path): c for n, c in captions.items()} == first
    shown = [check.captions(e)[0] for e in range(6)]
    assert all(c.startswith("sks dog, ") for c in shown)  # keep_tokens = 1 stays first
    assert len(set(shown)) > 1  # the rest is shuffled, differently per epoch
    assert sorted(shown[0].split(", ")) == sorted(CAPTION.split(", "))


def test_buckets_subsets_and_regularization(dataset_toml):
    data = summary(check_dataset(dataset_toml), epoch=0)
    assert data["problems"] == []
    train, reg = data["subsets"]
    assert (train["is_reg"], train["images"], train["samples"]) == (False, 4, 8)
    # sd-scripts' balancing: 3 regularization images supply 8 samples (repeats 3, 3, 2)
    assert (reg["is_reg"], reg["images"], reg["used"], reg["samples"]) == (True, 3, 3, 8)
    buckets = {tuple(b["size"]): (len(b["images"]), b["samples"]) for b in data["datasets"][0]["buckets"]}
    assert sum(n for n, _ in buckets.values()) == 7 and sum(s for _, s in buckets.values()) == 16
    assert buckets[(512, 512)] == (5, 12)  # t0 and t3 (2 repeats each) and the 3 regularization images
    reg_images = [i for i in data["images"] if i["is_reg"]]
    assert {i["caption"] for i in reg_images} == {"a dog"}


@pytest.mark.parametrize("trainer", ["sdxl-lora", "flux-lora"])
def test_the_check_holds_out_what_the_trainer_holds_out(dataset_toml, tmp_path, trainer):
    """--validation_split: the images held out for the validation loss are not in the epoch the check shows, and the
    regularization images are balanced against the images left, as the trainer's own split does."""
    run_config = tmp_path / "run.toml"
    run_config.write_text("validation_split = 0.25\nseed = 3\n")
    check = check_dataset(dataset_toml, trainer=trainer, config_toml=run_config)
    trainer_dataset, held_out = build_split_datasets(load_dataset_config(dataset_toml), seed=3, validation_split=0.25)
    assert [i.path for i in check.images if i.held_out] == [r.image.path for r in held_out.records]
    assert sorted(check.dataset.samples) == sorted(trainer_dataset.samples)
    train, reg = summary(check, epoch=0)["subsets"]
    assert (train["images"], train["samples"]) == (3, 6)  # 4 images with 2 repeats, one held out
    assert reg["samples"] == 6  # balanced against the 6 training samples left, as the trainer does


def test_every_problem_is_listed_where_the_trainer_stops_at_the_first(tmp_path):
    folder = tmp_path / "images"
    _image(folder / "good.png", (1024, 1024))
    _image(folder / "small.png", (300, 200))
    _image(folder / "nocaption.png", (1024, 1024), caption=None)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (folder / "broken.txt").write_text("a caption")
    check = check_dataset(folder, resolution=512)
    by_name = {i.path.name: i for i in check.images}
    assert by_name["good.png"].problems == [] and by_name["good.png"].record is not None
    assert "missing caption" in by_name["nocaption.png"].problems[0] and by_name["nocaption.png"].record is None
    assert by_name["broken.png"].problems[0].startswith("unreadable") and by_name["broken.png"].record is None
    small = by_name["small.png"]
    assert small.upscaled and "will be upscaled from 300x200" in small.problems[0] and small.record is not None
    assert len(check.problems) == 3
    with pytest.raises(UserError):  # the trainer itself stops at the first of them
        build_dataset(check.configs, seed=0)


def test_a_bad_toml_is_one_error_naming_the_key(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('[[datasets]]\nresolution = 512\n  [[datasets.subsets]]\n  image_dri = "x"\n')
    with pytest.raises(UserError, match="image_dri.*image_dir"):
        check_dataset(toml)
    with pytest.raises(UserError, match="no such file or folder"):
        check_dataset(tmp_path / "missing")


def test_dataset_page_data_over_http(dataset_toml):
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from dreamstep.dashboard.app import create_app

    c = TestClient(create_app([], dataset=str(dataset_toml)))
    assert c.get("/api/info").json()["dataset"] == str(dataset_toml)
    epoch0, epoch1 = c.get("/api/dataset").json(), c.get("/api/dataset?epoch=1").json()
    assert epoch1["epoch"] == 1
    assert [i["raw_caption"] for i in epoch0["images"]] == [i["raw_caption"] for i in epoch1["images"]]
    assert [i["caption"] for i in epoch0["images"]] != [i["caption"] for i in epoch1["images"]]
    thumb = c.get("/api/dataset/image/0?size=64")
    assert thumb.headers["content-type"] == "image/jpeg"
    assert max(Image.open(__import__("io").BytesIO(thumb.content)).size) == 64
    assert c.get("/api/dataset/image/99").status_code == 404
    assert c.get("/api/dataset/image/-1").status_code == 404
    (Path(epoch0["images"][0]["path"]).parent / "new.png").write_bytes(b"not an image")
    rescanned = c.get("/api/dataset?rescan=1").json()
    assert any("new.png" in p for p in rescanned["problems"])
    Path(epoch0["images"][0]["path"]).write_bytes(b"now broken")  # a file decoded before is read again once changed
    rescanned = c.get("/api/dataset?rescan=1").json()
    assert any(p.startswith(epoch0["images"][0]["path"]) and "unreadable" in p for p in rescanned["problems"])


def test_the_check_shows_each_images_mask_and_names_an_all_black_one(tmp_path: Path) -> None:
    """A TOML with masks is read as --masked_loss reads it: alpha masks and a mask folder are served as images
    beside their image, and an all-black mask is a problem of its image."""
    import io

    from starlette.testclient import TestClient

    from dreamstep.dashboard.app import create_app

    alpha, plain, masks = tmp_path / "alpha", tmp_path / "plain", tmp_path / "masks"
    for folder in (alpha, plain, masks):
        folder.mkdir()
    for i, opaque_columns in enumerate((32, 16, 0)):  # the third image's alpha is black everywhere
        image = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
        if opaque_columns:
            image.paste((90, 120, 30, 255), (0, 0, opaque_columns, 64))
        image.save(alpha / f"a{i}.png")
        (alpha / f"a{i}.txt").write_text(CAPTION)
    _image(plain / "p0.png", (64, 64))
    mask = Image.new("RGB", (64, 64), "black")
    mask.paste((255, 255, 255), (0, 0, 64, 48))
    mask.save(masks / "p0.png")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"[general]\ncaption_extension = '.txt'\n[[datasets]]\nresolution = 64\n"
                    f"[[datasets.subsets]]\nimage_dir = '{alpha.as_posix()}'\nalpha_mask = true\n"
                    f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = '{plain.as_posix()}'\n"
                    f"conditioning_data_dir = '{masks.as_posix()}'\n")
    check = check_dataset(toml, resolution=64)
    images = {i["name"]: i for i in summary(check, 0)["images"]}
    assert all(i["mask"] for i in images.values())
    assert not images["a2.png"]["used"]
    assert "mask: the alpha channel is black everywhere" in images["a2.png"]["problems"][0]

    client = TestClient(create_app([], dataset=str(toml), dataset_check=check))
    names = [i.path.name for i in check.images]
    for name, white_columns, white_rows in (("a0.png", 32, 64), ("a1.png", 16, 64), ("p0.png", 64, 48)):
        response = client.get(f"/api/dataset/mask/{names.index(name)}?size=64")
        assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
        shown = np.asarray(Image.open(io.BytesIO(response.content)).convert("L"), dtype=np.float32)
        assert shown[: white_rows - 4, : white_columns - 4].min() > 200  # JPEG: away from the edges
        if white_columns < 64:
            assert shown[:, white_columns + 4:].max() < 50
        if white_rows < 64:
            assert shown[white_rows + 4:].max() < 50


def _folder_of_shapes(folder: Path) -> None:
    """Landscape, portrait and square images; one without a caption file."""
    for name, size in (("wide", (96, 64)), ("tall", (64, 96)), ("square", (64, 64))):
        _image(folder / f"{name}.png", size, caption=f"a {name} photo of sks robot")
    _image(folder / "bare.png", (96, 64), caption=None)


def test_the_check_reads_a_folder_as_the_chosen_trainer_with_its_runs_settings(tmp_path):
    """flux-lora with its run's config.toml: square crops at the run's resolution, the instance prompt for an image
    without a caption; sdxl-lora on a Kohya folder with buckets enabled: aspect buckets, the folder's class tokens."""
    _folder_of_shapes(tmp_path / "robot")
    run_config = tmp_path / "config.toml"
    run_config.write_text('pretrained_model_name_or_path = "black-forest-labs/FLUX.1-dev"\noutput_dir = "out"\n'
                          f'instance_data_dir = "{(tmp_path / "robot").as_posix()}"\n'
                          'instance_prompt = "sks robot"\nresolution = 48\nseed = 4\n')
    for check in (check_dataset(trainer="flux-lora", config_toml=run_config),  # the run's own data
                  check_dataset(tmp_path / "robot", trainer="flux-lora", config_toml=run_config)):
        by_name = {i.path.name: i for i in check.images}
        assert {i.bucket for i in check.images} == {(48, 48)} and check.problems == [] and check.seed == 4
        assert by_name["bare.png"].caption == "sks robot" and by_name["wide.png"].caption == "a wide photo of sks robot"
    assert {i.bucket for i in check_dataset(tmp_path / "robot", 32, instance_prompt="x").images} == {(32, 32)}

    kohya = tmp_path / "kohya" / "2_sks robot"
    _folder_of_shapes(kohya)
    (kohya / "bare.png").rename(kohya / "bare.jpg")
    sdxl_config = tmp_path / "sdxl.toml"
    sdxl_config.write_text('resolution = "64"\nenable_bucket = true\nmin_bucket_reso = 32\nbucket_reso_steps = 16\n'
                           'caption_extension = ".txt"\n')
    check = check_dataset(kohya.parent, trainer="sdxl-lora", config_toml=sdxl_config)
    by_name = {i.path.name: i for i in check.images}
    assert by_name["wide.png"].bucket[0] > by_name["wide.png"].bucket[1]
    assert by_name["tall.png"].bucket[0] < by_name["tall.png"].bucket[1]
    assert by_name["bare.jpg"].caption == "sks robot" and by_name["wide.png"].repeats == 2

    with pytest.raises(UserError, match="--instance_prompt is not an option of 'dreamstep train sdxl-lora'"):
        check_dataset(kohya.parent, trainer="sdxl-lora", instance_prompt="x")
    run_config.write_text("resolutoin = 48\n")
    with pytest.raises(UserError, match="config.toml: unknown key 'resolutoin'"):
        check_dataset(tmp_path / "robot", trainer="flux-lora", config_toml=run_config)


def test_the_dashboard_command_checks_with_the_trainer_and_config_given(tmp_path, capsys):
    from dreamstep.cli import main

    _folder_of_shapes(tmp_path / "robot")
    assert main(["dashboard", "--dataset", str(tmp_path / "robot"), "--trainer", "sdxl-lora"]) == 2
    assert "--train_data_dir" in capsys.readouterr().err  # sdxl-lora wants <repeats>_<class tokens> folders
    assert main(["dashboard", "--dataset", str(tmp_path / "robot"), "--config", str(tmp_path / "none.toml")]) == 2
    assert "none.toml: file not found" in capsys.readouterr().err
