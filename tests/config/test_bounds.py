"""Every number every command takes has a declared range, checked at the door: for each numeric flag of
each command, a value below or above its range, NaN and infinity each get one error naming the flag."""

from __future__ import annotations

import math
import typing

import pytest

from dreamstep.cli import COMMANDS
from dreamstep.commands.dataset_from_hf import FromHfConfig
from dreamstep.config.schema import Bounds, _fields, _unwrap_optional, build_config
from dreamstep.errors import UserError


def _config_classes() -> list[type]:
    classes = []
    for command in COMMANDS.values():
        if command.options is not None:
            module, _, name = command.options.partition(":")
            classes.append(getattr(__import__(module, fromlist=[name]), name))
    return [*classes, FromHfConfig]


def _numeric_fields() -> list[tuple[type, str, type, Bounds | None]]:
    found = []
    for cls in _config_classes():
        for name, (field, tp) in _fields(cls).items():
            base, _ = _unwrap_optional(tp)
            if typing.get_origin(base) is list:
                (base,) = typing.get_args(base)
            if base in (int, float):
                found.append((cls, name, base, field.metadata.get("bounds")))
    return found


NUMERIC = _numeric_fields()


def _outside(kind: type, bounds: Bounds) -> list[str]:
    """Values just outside each finite end of ``bounds``."""
    step = 1 if kind is int else 0.5
    values = []
    if not math.isinf(bounds.low):
        values.append(bounds.low - step if bounds.low_closed else bounds.low)
    if not math.isinf(bounds.high):
        values.append(bounds.high + step if bounds.high_closed else bounds.high)
    return [str(int(v)) if kind is int else repr(float(v)) for v in values]


def test_every_numeric_flag_declares_its_range() -> None:
    assert len(NUMERIC) > 90
    undeclared = [f"{cls.__name__}.{name}" for cls, name, _, bounds in NUMERIC if bounds is None]
    assert undeclared == []


CASES = [(cls, name, value) for cls, name, kind, bounds in NUMERIC
         for value in [*_outside(kind, bounds), *(["nan", "inf", "-inf"] if kind is float else [])]]


@pytest.mark.parametrize("cls, name, value", CASES, ids=[f"{c.__name__}.{n}={v}" for c, n, v in CASES])
def test_out_of_range_values_are_refused_naming_the_flag(cls: type, name: str, value: str) -> None:
    with pytest.raises(UserError, match=f"^--{name}(:| must)"):
        build_config(cls, {name: value})


@pytest.mark.parametrize("cls, name", [(cls, name) for cls, name, *_ in NUMERIC])
def test_the_default_lies_in_its_range(cls: type, name: str) -> None:
    field, _ = _fields(cls)[name]
    bounds = field.metadata["bounds"]
    if field.default is not None:
        assert field.default in bounds


def test_a_toml_value_out_of_range_names_the_file_and_key(tmp_path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("adam_beta1 = 2.0\n")
    with pytest.raises(UserError, match=r"run.toml: key 'adam_beta1' must be in \[0, 1\) \(got 2\)"):
        build_config(_config_classes()[0], toml_path=config)
