"""A refused run leaves nothing behind: for every trainer, input faults that only reading the data finds (an image
that does not decode, a caption file that is not UTF-8) and an --output_dir that holds another run are one line
naming the file or flag, and the output folder is not made (or, when it was there, is byte for byte as it was)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from flux_testkit import ROBOT_DIR, run_cli
from test_option_contract import TRAINERS, _recipe, _smallest_run


def _tree(folder: Path) -> dict[str, bytes] | None:
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in sorted(folder.rglob("*"))}


def _with_fault(values: dict[str, str], root: Path, fault: str) -> dict[str, str]:
    """``values`` reading a copy of the robot images with ``fault`` in it, wherever they read the robot folder
    (a flag, or a dataset TOML's ``image_dir``)."""
    data = root / "faulty"
    shutil.copytree(ROBOT_DIR, data)
    if fault == "image that does not decode":
        (data / "robot_9.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    else:  # a caption in UTF-16, as some editors save it (.txt, and sd-scripts' default .caption)
        for suffix in (".txt", ".caption"):
            (data / f"robot_0{suffix}").write_bytes("a robot".encode("utf-16"))
    faulty = {}
    for key, value in values.items():
        if value == str(ROBOT_DIR):
            value = str(data)
        elif value.endswith(".toml") and Path(value).is_file():
            toml = Path(value)
            toml.write_text(toml.read_text().replace(ROBOT_DIR.as_posix(), data.as_posix()))
        faulty[key] = value
    return faulty


def _argv(trainer: str, values: dict[str, str]) -> list[str]:
    return ["train", trainer, *(item for key, value in values.items() for item in (f"--{key}", value))]


@pytest.mark.parametrize("fault", ["image that does not decode", "caption that is not UTF-8"])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_data_fault_is_one_line_and_writes_nothing(trainer: str, fault: str, tiny_flux_dev_dir: Path,
                                                     tiny_sdxl_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    values = _with_fault(_smallest_run(trainer, {"flux": tiny_flux_dev_dir, "sdxl": tiny_sdxl_dir}, tmp_path),
                         tmp_path, fault)
    capsys.readouterr()
    assert run_cli(*_argv(trainer, values)) == 2
    err = capsys.readouterr().err
    named = ("robot_9.png",) if fault.startswith("image") else ("robot_0.txt", "robot_0.caption")
    assert err.startswith("error: ") and any(n in err for n in named) and err.count("\n") == 1, err
    assert _tree(Path(values["output_dir"])) is None, sorted(_tree(Path(values["output_dir"])))


@pytest.mark.parametrize("trainer", TRAINERS)
def test_an_output_dir_of_another_run_is_left_as_it_was(trainer: str, tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    values = _smallest_run(trainer, {"flux": tiny_flux_dev_dir, "sdxl": tiny_sdxl_dir}, tmp_path)
    out = Path(values["output_dir"])
    (out / "checkpoint-7").mkdir(parents=True)
    (out / "checkpoint-7" / "trainer_state.json").write_text('{"global_step": 7}')
    (out / "config.toml").write_text('# another run\nseed = 99\n')
    (out / "train.log").write_text("another run's log\n")
    before = _tree(out)
    capsys.readouterr()
    assert run_cli(*_argv(trainer, values)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert _tree(out) == before


def _late_flags(trainer: str, root: Path) -> dict[str, tuple[str, str]]:
    """Flags of ``trainer`` whose fault shows only when the file is read: each with a faulty value and what the
    line must name."""
    fields = {f.name for f in dataclasses.fields(_recipe(trainer)[0])}
    not_a_checkpoint = root / "not-a-checkpoint"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "notes.txt").write_text("no trainer state here")
    garbage = root / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    prompts = root / "prompts.txt"
    prompts.write_text("a robot --w 0\n")
    late = {"resume_from_checkpoint": (str(not_a_checkpoint), "not-a-checkpoint"),
            "resume": (str(not_a_checkpoint), "not-a-checkpoint"),
            "network_weights": (str(garbage), "garbage.safetensors"),
            "sample_prompts": (str(prompts), "prompts.txt")}
    return {flag: value for flag, value in late.items() if flag in fields}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_flag_whose_file_is_faulty_is_one_line_and_writes_nothing(trainer: str, tiny_flux_dev_dir: Path,
                                                                    tiny_sdxl_dir: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    values = _smallest_run(trainer, {"flux": tiny_flux_dev_dir, "sdxl": tiny_sdxl_dir}, tmp_path)
    for flag, (value, named) in _late_flags(trainer, tmp_path).items():
        out = tmp_path / f"out-{flag}"
        capsys.readouterr()
        assert run_cli(*_argv(trainer, {**values, flag: value, "output_dir": str(out)})) == 2, flag
        err = capsys.readouterr().err
        assert err.startswith("error: ") and named in err and err.count("\n") == 1, (flag, err)
        assert _tree(out) is None, (flag, sorted(_tree(out)))
