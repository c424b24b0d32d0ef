import argparse
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from dreamstep.config.schema import add_arguments, build_config, config_to_toml, load_toml, option
from dreamstep.errors import UserError


@dataclass
class Example:
    output_dir: str = option(help="where")
    rank: int = option(4, "LoRA rank")
    scale: float = option(1.0, "a float")
    flip: bool = option(False, "a bool")
    layers: list[str] = option(["attention"], "a list")
    precision: Literal["no", "fp16", "bf16"] = option("no", "a choice")
    limit: Optional[int] = option(None, "optional int")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    return parser.parse_args(argv)


def test_command_line_beats_toml_beats_defaults(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('output_dir = "a"\nrank = 8\nscale = 2\nlayers = ["x", "y"]\n')
    config = build_config(Example, parse(["--config", str(toml), "--rank", "16", "--flip", "--limit", "3"]))
    assert config == Example(output_dir="a", rank=16, scale=2.0, flip=True, layers=["x", "y"], limit=3)
    assert build_config(Example, parse(["--output_dir", "b", "--flip", "false", "--limit", "none"])).flip is False


def test_saved_config_reads_back(tmp_path):
    config = Example(output_dir='with "quotes"', layers=["a", "b"], limit=2, precision="bf16")
    path = tmp_path / "saved.toml"
    path.write_text(config_to_toml(config))
    assert build_config(Example, toml_path=path) == config


@pytest.mark.parametrize("argv, toml, message", [
    (["--output_dir", "o", "--precision", "bf61"], None,
     "--precision: 'bf61' is not a valid choice (did you mean 'bf16'?)"),
    (["--output_dir", "o", "--rank", "4.5"], None, "--rank: '4.5' is not an integer"),
    (["--output_dir", "o", "--flip", "maybe"], None, "--flip: 'maybe' is not a boolean"),
    ([], None, "--output_dir is required"),
    ([], 'output_dir = "o"\nrnak = 3\n', "unknown key 'rnak' (did you mean 'rank'?)"),
    ([], 'output_dir = "o"\nrank = "four"\n', "key 'rank': \"four\" is a string; write a number without quotes"),
    ([], 'output_dir = "o"\nflip = "yes"\n', "key 'flip': \"yes\" is a string; write true or false without quotes"),
    ([], 'output_dir = "o"\nscale = nan\n', "key 'scale': 'nan' is not a finite number"),
    ([], b'\xff\xfeoutput_dir = "o"\n', "not UTF-8 text (byte 0); save the file as UTF-8"),
    ([], 'output_dir = "o"\nrank = [', "not valid TOML"),
    ([], 'output_dir = "o"\nrank = 99999999999999999999\n',
     "key 'rank': 99999999999999999999 is beyond the largest integer a run can use"),
    ([], 'output_dir = "o\\u0000"\n', "key 'output_dir': the value holds a NUL character"),
    ([], 'output_dir = "o"\nlayers = ["x", "\\u0000"]\n', "key 'layers': the value holds a NUL character"),
])
def test_bad_values_name_the_flag_or_key(tmp_path, argv, toml, message):
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_bytes(toml if isinstance(toml, bytes) else toml.encode())
        argv = [*argv, "--config", str(path)]
    with pytest.raises(UserError) as error:
        build_config(Example, parse(argv))
    assert message in str(error.value)
    if toml is not None:
        assert "bad.toml" in str(error.value)


def test_missing_toml_file_is_named(tmp_path):
    with pytest.raises(UserError, match="--config .*nope.toml: file not found"):
        load_toml(tmp_path / "nope.toml")


def test_a_repeated_list_flag_adds_to_the_list():
    config = build_config(Example, parse(["--output_dir", "o", "--layers", "a", "--layers", "b", "c"]))
    assert config.layers == ["a", "b", "c"]


def test_refuse_unused_names_the_flag_only_when_it_was_changed():
    from dreamstep.config.schema import refuse_unused

    refuse_unused(Example(output_dir="o"), ("rank", "limit"), "here")
    with pytest.raises(UserError, match="--rank has no effect with X; remove it"):
        refuse_unused(Example(output_dir="o", rank=8), ("rank",), "with X")


@pytest.mark.parametrize("path, message", [
    ("a_file/run", "a_file is a file, so the folder cannot be made there"),
    ("/proc/no-such-run", "cannot make the folder in /proc"),
])
def test_a_folder_that_cannot_be_made_is_refused_before_anything_is_written(tmp_path, monkeypatch, path, message):
    from dreamstep.engine.run_folder import check_output_dir
    from dreamstep.files import check_folder_can_be_made

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UserError, match=f"--cache_dir {path}: {message}"):
        check_folder_can_be_made(path, "--cache_dir")
    with pytest.raises(UserError, match=f"--output_dir {path}: {message}"):
        check_output_dir(path, overwrite=False, resume=None, resume_request=None, resume_flag="--resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    check_folder_can_be_made(tmp_path / "new" / "deeper", "--cache_dir")
    assert not (tmp_path / "new").exists()
