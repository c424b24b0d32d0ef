"""A run's ``config.toml`` reads back as the run's settings, whatever its strings hold (issue 39): every option of
every trainer written and read back for every value its type allows; tables, arrays and dates where a trainer
expects one value are one line naming the key; what TOML cannot hold is refused before anything starts."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from dreamstep.cli import COMMANDS, _load, main
from dreamstep.config.schema import build_config, config_to_toml, convert_value, toml_value
from dreamstep.errors import UserError

try:
    import tomllib
except ImportError:  # pragma: no cover
    import tomli as tomllib

TRAINERS = {key[1]: _load(command.options) for key, command in COMMANDS.items() if key[0] == "train"}
# Everything a basic string must escape, and what it must not: newlines, quotes, backslashes, control characters
# (DEL, backspace, form feed; not NUL, which no value may hold), TOML's own syntax, and text beyond ASCII.
STRINGS = ["a photo of sks robot\non the moon\r\n", 'say "hi" \\ C:\\data\\new\\t', "tab\there\x01\x1f\x7f\b\f",
           "ünïcödé 猫 🐱 \u2028 \ufeff", "'''triple''' \"\"\" # not a comment", "x = 1\n[table]\ny = [", "", " "]
TEXT = "".join(STRINGS[:5])
REQUIRED = {"pretrained_model_name_or_path": "some-org/some-model", "output_dir": TEXT}
DATA = {"flux-lora": {"instance_data_dir": TEXT, "instance_prompt": TEXT, "validation_prompt": TEXT},
        "sdxl-lora": {"train_data_dir": TEXT}, "flux-kohya": {"train_data_dir": TEXT},
        "flux-controlnet": {"jsonl_for_train": f"{TEXT}.jsonl", "validation_prompt": [TEXT, STRINGS[0]],
                            "validation_image": [TEXT, STRINGS[3]]},
        "flux-kontext-lora": {"instance_data_dir": TEXT, "instance_prompt": TEXT, "validation_prompt": TEXT}}
NUMBERS: dict[type, list[Any]] = {int: [0, -3, 2**40], float: [1e-07, 0.1, -2.5, 3.0, 1e16, 123456.789e-3]}


def _values(tp: Any) -> list[Any]:
    """Values of type ``tp`` that a config can hold (``None`` aside: config.toml leaves it out)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    if typing.get_origin(tp) is typing.Union or type(tp).__name__ == "UnionType":
        return _values(args[0])
    if typing.get_origin(tp) is list:
        items = _values(args[0])
        return [[], items, items[:1]]
    return {bool: [True, False], str: STRINGS, **NUMBERS}[tp]


def _options(trainer: str) -> dict[str, Any]:
    config_class = TRAINERS[trainer]
    hints = typing.get_type_hints(config_class)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_class) if f.init}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_option_of_every_trainer_reads_back_as_written(trainer: str) -> None:
    for name, tp in _options(trainer).items():
        for value in _values(tp):
            line = f"{name} = {toml_value(value)}\n"
            read = convert_value(tomllib.loads(line)[name], tp, name, typed=True)
            assert read == value and type(read) is type(value), (name, line)


def _data(trainer: str) -> dict[str, Any]:
    """The data flags of ``trainer``: FLUX.1's and SDXL's above, another family's from its recipe's folder flag."""
    if trainer in DATA:
        return DATA[trainer]
    recipe = importlib.import_module(COMMANDS[("train", trainer)].runner.partition(":")[0])
    fields = {f.name for f in dataclasses.fields(TRAINERS[trainer])}
    return {recipe.FOLDER_FLAG: TEXT, **{flag: TEXT for flag in ("instance_prompt", "conditioning_data_dir")
                                         if flag in fields}}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_runs_config_toml_with_any_text_resumes_as_the_same_settings(trainer: str, tmp_path: Path) -> None:
    config = build_config(TRAINERS[trainer], {**REQUIRED, **_data(trainer)})
    saved = tmp_path / "config.toml"
    saved.write_text(config_to_toml(config), encoding="utf-8")
    assert build_config(TRAINERS[trainer], toml_path=saved) == config


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_table_an_array_or_a_date_for_a_single_value_is_one_line_naming_the_key(trainer: str,
                                                                                tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    for name, tp in _options(trainer).items():
        wrong = ["{ value = 1e-4 }", "1979-05-27"] + ([] if _values(tp) and isinstance(_values(tp)[0], list)
                                                      else ["[1e-4, 2e-4]"])
        for text in wrong:
            config.write_text(f"{name} = {text}\n")
            with pytest.raises(UserError) as error:
                build_config(TRAINERS[trainer], REQUIRED, toml_path=config)
            message = str(error.value)
            assert f"bad.toml: key '{name}': expected " in message and "\n" not in message, message
            assert {"{": "got a table", "[": "got an array", "1": "got a date (1979-05-27)"}[text[0]] in message


def test_a_learning_rate_table_through_the_command_line_is_one_error_line(tmp_path: Path, capsys) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[learning_rate]\nvalue = 1e-4\n")
    assert main(["train", "flux-lora", "--config", str(config), "--pretrained_model_name_or_path", "m",
                 "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {config}: key 'learning_rate': expected a number, got a table\n"
    assert not (tmp_path / "out").exists()


def test_an_argument_that_is_not_utf8_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    """A shell passes bytes; Python decodes those that are not UTF-8 to lone surrogates, which no TOML file holds."""
    prompt = b"a photo of \xff robot".decode("utf-8", "surrogateescape")
    assert main(["train", "flux-lora", "--pretrained_model_name_or_path", "m", "--output_dir", str(tmp_path / "out"),
                 "--instance_data_dir", "d", "--instance_prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --instance_prompt: 'a photo of \\xff robot' is not valid UTF-8 text (bytes the saved "
                   "settings cannot record); give UTF-8 text, or rename the file or folder\n")
    assert not (tmp_path / "out").exists()


def test_table_keys_and_values_are_written_as_toml_reads_them() -> None:
    table = {"plain_key-1": "a\nb", "needs quotes": [1, 2.5, True], "ü": {"inner": "\\"}, "": {}}
    assert tomllib.loads(f"t = {toml_value(table)}")["t"] == table


@pytest.mark.parametrize("trainer", TRAINERS)
def test_help_and_config_toml_show_model_and_data_first_and_validation_and_output_last(trainer: str,
                                                                                      capsys) -> None:
    from dreamstep.cli import main
    from dreamstep.config.sections import SECTIONS, section_of

    with pytest.raises(SystemExit):
        main(["train", trainer, "--help"])
    text = capsys.readouterr().out
    shown = [title for title in SECTIONS if f"\n{title} options:\n" in text]
    assert shown[:2] == ["model", "data"] and shown == sorted(shown, key=SECTIONS.index)
    assert text.index("\nmodel options:\n") < text.index("\n  --pretrained_model_name_or_path")
    toml = config_to_toml(build_config(TRAINERS[trainer], {**REQUIRED, **_data(trainer)}))
    keys = [line.split(" = ")[0] for line in toml.splitlines() if " = " in line and not line.startswith("#")]
    order = [SECTIONS.index(section_of(key)) for key in keys]
    assert order == sorted(order) and toml.startswith("# model\n")
    assert keys[0] == "pretrained_model_name_or_path" and section_of(keys[-1]) == "output"
