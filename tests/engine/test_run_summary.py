"""The start-of-run summary: images and skipped files, buckets, captions cut by the text encoder, and the
number of processes that really run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import CLIPTokenizer

from dreamstep.cli import main
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import build_dataset
from dreamstep.data.sources import bucket_spec, dreambooth_from_flags
from dreamstep.engine import summary


@pytest.fixture
def captioned(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for name, size in (("short", (32, 32)), ("long", (32, 32)), ("wide", (64, 32))):
        Image.new("RGB", size, (120, 30, 30)).save(folder / f"{name}.png")
    (folder / "short.txt").write_text("\ufeffa photo of sks robot", encoding="utf-8")  # with a byte-order mark
    (folder / "long.txt").write_text(" ".join(["robot"] * 100), encoding="utf-8")
    (folder / "wide.txt").write_text("a wide robot", encoding="utf-8")
    (folder / "notes.md").write_text("x")
    return folder


def _dataset(folder: Path):
    config = dreambooth_from_flags(folder, "sks robot", caption_extension=".txt",
                                   buckets=bucket_spec(32, enable_bucket=True, min_bucket_reso=16,
                                                       max_bucket_reso=64, bucket_reso_steps=16))
    return build_dataset([config], seed=0)


def test_images_skipped_files_and_buckets_are_listed(captioned: Path) -> None:
    lines = summary.describe_data(_dataset(captioned))
    assert lines[0] == f"images      {captioned}: 3 images, 3 samples per epoch"
    assert f"skipped     {captioned / 'notes.md'}: not an image type dreamstep reads (.md)" in lines
    assert lines[-1] == "buckets     32x32: 3"


def test_the_trainer_lists_the_skipped_files_before_training(captioned: Path, tiny_flux_dir: Path,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The trainers split off held-out images before the summary: the skipped files must survive that."""
    (captioned / "dangling.png").symlink_to(captioned / "gone.png")
    (captioned / "loop.png").symlink_to(captioned / "loop.png")
    assert main(["train", "flux-lora", "--pretrained_model_name_or_path", str(tiny_flux_dir), "--output_dir",
                 str(tmp_path / "out"), "--instance_data_dir", str(captioned), "--instance_prompt", "sks robot",
                 "--caption_extension", ".txt", "--resolution", "32", "--center_crop", "--validation_split", "0.3",
                 "--max_train_steps", "1", "--report_to", "none"]) == 0
    out = capsys.readouterr().out
    assert f"images      {captioned}: 2 images, 2 samples per epoch" in out
    for name, reason in (("dangling.png", "broken link (its target is missing)"), ("loop.png", "link loop"),
                         ("notes.md", "not an image type dreamstep reads (.md)")):
        assert f"skipped     {captioned / name}: {reason}" in out
    assert "written now, 0 were there already" in out


def test_a_caption_byte_order_mark_is_dropped_and_cut_captions_are_named(captioned: Path,
                                                                       tiny_flux_dir: Path) -> None:
    dataset = _dataset(captioned)
    tokenizer = CLIPTokenizer.from_pretrained(tiny_flux_dir / "tokenizer")
    short = next(r for r in dataset.records if r.image.path.stem == "short")
    assert short.caption == "a photo of sks robot"
    assert tokenizer(short.caption).input_ids == tokenizer("a photo of sks robot").input_ids
    lines = summary.describe_truncation(dataset, {"CLIP": (tokenizer, 77)})
    tokens = len(tokenizer(" ".join(["robot"] * 100)).input_ids)
    assert lines == [f"truncated   {captioned / 'long.txt'}: {tokens} tokens, CLIP reads 77"]


def test_a_launch_that_asked_for_more_processes_than_run_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """`accelerate launch --cpu --num_processes 2` without --multi_gpu starts one process, silently."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--num_processes", "2"])
    cmdline = Path(f"/proc/{launcher.pid}/cmdline")
    deadline = time.monotonic() + 30
    while b"--num_processes" not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)  # the child has not exec'd yet
    try:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
        monkeypatch.setattr(summary.os, "getppid", lambda: launcher.pid)
        accelerator = SimpleNamespace(num_processes=1, device=SimpleNamespace(type="cpu"))
        lines = summary.describe_processes(accelerator)
    finally:
        launcher.kill()
    assert lines[0] == "processes   1 on 1 node (cpu)"
    assert lines[1].startswith("warning     accelerate launch asked for 2 processes but 1 runs")


def test_the_caches_line_tells_entries_written_now_from_those_of_earlier_runs(tmp_path: Path) -> None:
    earlier = TensorCache(tmp_path / "latents", "model-a")
    for key in ("one", "two"):
        earlier.put(key, {"x": torch.zeros(1)})
    now = TensorCache(tmp_path / "latents", "model-a")
    now.put("three", {"x": torch.zeros(1)})
    assert now.get("one") is not None
    line = summary.describe_caches({"latents": now, "text": None})
    assert line == f"caches      latents: {tmp_path / 'latents'} (1 entry written now, 2 were there already); text: off"


def test_zero_stage_in_one_process_is_said_to_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(summary, "requested_processes", lambda: None)
    one = SimpleNamespace(num_processes=1, device=SimpleNamespace(type="cpu"))
    lines = summary.describe_processes(one, sharded_stage=2)
    assert lines == ["processes   1 on 1 node (cpu)",
                     "note        --zero_stage 2 does nothing in one process: sharding spreads the trainable state "
                     "over several (accelerate launch --multi_gpu --num_processes N -m dreamstep train ...)"]
    two = SimpleNamespace(num_processes=2, device=SimpleNamespace(type="cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert summary.describe_processes(two, sharded_stage=3) == [
        "processes   2 on 1 node (cpu); FSDP2 --zero_stage 3: each holds 1/2 of the trainable state"]


def _train(tiny_flux_dir: Path, out: Path, *extra: str) -> int:
    return main(["train", "flux-lora", "--pretrained_model_name_or_path", str(tiny_flux_dir), "--output_dir",
                 str(out), "--resolution", "32", "--max_train_steps", "1", "--report_to", "none", *extra])


def test_the_held_out_images_are_named_and_a_tiny_split_still_holds_one_out(captioned: Path, tiny_flux_dir: Path,
                                                                            tmp_path: Path, capsys) -> None:
    assert _train(tiny_flux_dir, tmp_path / "out", "--instance_data_dir", str(captioned), "--instance_prompt",
                  "sks robot", "--center_crop", "--validation_split", "0.001") == 0
    out = capsys.readouterr().out
    held = [line.strip() for line in out.splitlines() if line.strip().startswith("held out")]
    assert len(held) == 1 and held[0].startswith("held out    1 image for the validation loss, not trained on: ")
    assert held[0].rsplit(": ", 1)[1] in {str(captioned / f"{n}.png") for n in ("short", "long", "wide")}
    assert f"images      {captioned}: 2 images" in out
    log = (tmp_path / "out" / "train.log").read_text()  # the summary is in the run's log too
    assert " run:\n" in log and held[0] in log and " memory plan: estimated peak memory of each phase\n" in log


def test_the_batch_size_of_a_dataset_toml_is_the_one_reported(captioned: Path, tiny_flux_dir: Path,
                                                              tmp_path: Path, capsys) -> None:
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = 32\n[[datasets]]\nbatch_size = 2\n[[datasets.subsets]]\n'
                    f'image_dir = "{captioned}"\nclass_tokens = "sks robot"\n')
    assert _train(tiny_flux_dir, tmp_path / "out", "--dataset_config", str(toml)) == 0
    out = capsys.readouterr().out
    assert "effective batch 2 = 2 per process x 1 accumulated x 1 process" in out
    assert "training pass: 32px, batch 2," in out  # the memory plan prices the TOML's batch too


def test_best_by_val_loss_without_held_out_images_is_refused(captioned: Path, tiny_flux_dir: Path,
                                                             tmp_path: Path, capsys) -> None:
    assert _train(tiny_flux_dir, tmp_path / "out", "--instance_data_dir", str(captioned), "--instance_prompt",
                  "sks robot", "--eval_best_by", "val_loss") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --eval_best_by val_loss: this run holds out no images, so it has no validation loss; add "
        "--validation_split (e.g. 0.1) or held-out images, or pick one of --eval_metrics")
    assert not (tmp_path / "out").exists()


def test_the_dataset_check_and_the_trainer_read_a_folder_alike_and_images_without_captions_are_named(
        captioned: Path, tiny_flux_dir: Path, tmp_path: Path, capsys) -> None:
    """flux-lora's defaults: .txt captions where they exist, the instance prompt for the rest, square crops
    at --resolution; the dashboard's dataset check shows the same."""
    from dreamstep.dashboard.dataset_check import check_dataset

    Image.new("RGB", (48, 32), (10, 200, 30)).save(captioned / "bare.png")
    check = check_dataset(captioned, resolution=32, instance_prompt="sks robot")
    by_name = {i.path.name: i for i in check.images}
    assert by_name["bare.png"].caption == "sks robot" and by_name["short.png"].caption == "a photo of sks robot"
    assert {(w, h) for _, w, h in check.dataset.sample_group} == {(32, 32)}
    assert _train(tiny_flux_dir, tmp_path / "out", "--instance_data_dir", str(captioned), "--instance_prompt",
                  "sks robot") == 0
    out = capsys.readouterr().out
    assert ("captions    1 image of --instance_data_dir without a .txt file train with --instance_prompt "
            "'sks robot': bare.png\n") in out
    assert "buckets     32x32: 4\n" in out
