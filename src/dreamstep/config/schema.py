"""Typed configuration: one dataclass per command is the schema for its CLI flags and its TOML file.

A field's docstring lives in ``field(metadata={"help": ...})`` via :func:`option`. Values are taken in
the order defaults < ``--config`` TOML < command line, converted to the field's type, and checked;
unknown keys and bad values raise :class:`~dreamstep.errors.UserError` naming the flag or the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from dreamstep.config.sections import in_section_order, section_of
from dreamstep.errors import UserError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")
# What numpy's and Python's seeding accept (accelerate's set_seed seeds numpy too).
SEED_BOUNDS = "[0, 4294967296)"
# A LoRA rank above the widest layer of any model trained here (FLUX.2 [dev]: 6144) adapts nothing more; beyond
# it a typo (an extra digit or two) would only fail later, out of memory.
RANK_BOUNDS = "[1, 8192]"
_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *, bounds: str | None = None, aliases: tuple[str, ...] = (),
           **kwargs: Any) -> Any:
    """A dataclass field with a help text and, for a number, the interval its values must lie in, written as
    in mathematics: ``"[0, 1)"``, ``"(0, inf)"``. Every numeric field declares one, so a value out of range
    stops the command before any work starts. ``aliases``: other names users type for it (another
    command's name for the same thing), accepted as flags and TOML keys."""
    metadata = {"help": help, "bounds": Bounds.parse(bounds) if bounds else None, "aliases": aliases}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def parse_key_values(items: Iterable[str], flag: str, example: str) -> dict[str, str]:
    """sd-scripts' list of ``key=value`` words (``--optimizer_args weight_decay=0.05``) as a dict of the
    stripped texts; a word without ``=`` or key is an error naming ``flag`` and showing ``example``."""
    parsed: dict[str, str] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{flag}: '{item}' is not key=value (e.g. {example})")
        parsed[key.strip()] = text.strip()
    return parsed


@dataclass(frozen=True)
class Bounds:
    """An interval of allowed numbers; ``low_closed``/``high_closed`` say whether the ends are allowed."""

    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> Bounds:
        match = re.fullmatch(r"([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])", text)
        if match is None:
            raise ValueError(f"bounds {text!r} is not an interval such as '[0, 1)'")
        return cls(float(match[2]), float(match[3]), match[1] == "[", match[4] == "]")

    def __contains__(self, value: float) -> bool:
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def describe(self) -> str:
        """The rule in words, e.g. "at least 1", "positive", "in [0, 1)"."""
        if math.isinf(self.high):
            if self.low_closed:
                return f"at least {_number(self.low)}"
            return "positive" if self.low == 0 else f"greater than {_number(self.low)}"
        low, high = "[" if self.low_closed else "(", "]" if self.high_closed else ")"
        return f"in {low}{_number(self.low)}, {_number(self.high)}{high}"


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def check_bounds(value: Any, bounds: Bounds | None, where: str) -> None:
    """Raise a UserError naming ``where`` when a number (or any number in a list) lies outside ``bounds``."""
    if bounds is None or value is None:
        return
    for number in value if isinstance(value, (list, tuple)) else [value]:
        if number not in bounds:
            raise UserError(f"{where} must be {bounds.describe()} (got {_number(float(number))})")


def load_toml(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """Read a TOML file given with ``flag``; a missing file, a file that is not UTF-8 or a syntax error
    becomes one line naming the file and the flag."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{flag} {path}: file not found; check the path")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{flag} {path}: not valid TOML ({e}); fix the syntax at that line") from None


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _parse_bool(text: str, where: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise UserError(f"{where}: '{text}' is not a boolean; use true or false")


def convert_value(value: Any, tp: Any, where: str, *, typed: bool = False) -> Any:
    """Convert a CLI string or TOML value to ``tp``; ``where`` names the flag or key in errors. A ``typed``
    value (from TOML, which has booleans and numbers) must already be a boolean or a number where one is
    expected: ``enable_bucket = "yes"`` is a mistake to point at, not a string to interpret."""
    tp, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.strip().lower() == "none"):
        if optional:
            return None
        raise UserError(f"{where}: a value is required")
    if typed and isinstance(value, str) and (tp is bool or tp in (int, float)):
        example = "true or false" if tp is bool else "a number"
        raise UserError(f"{where}: \"{value}\" is a string; write {example} without quotes")
    origin = typing.get_origin(tp)
    if _wrong_kind(value, tp):
        raise UserError(f"{where}: expected {_expected(tp)}, got {_kind(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if str(value) == str(choice):
                return choice
        names = ", ".join(str(c) for c in choices)
        hint = did_you_mean(value, choices)
        raise UserError(f"{where}: '{value}' is not a valid choice{hint}; choose one of {names}")
    if origin in (list, tuple):
        (item_tp,) = typing.get_args(tp)[:1] or (str,)
        items = value if isinstance(value, (list, tuple)) else [value]
        return [convert_value(v, item_tp, where, typed=typed) for v in items]
    if tp is bool:
        return value if isinstance(value, bool) else _parse_bool(value, where)
    if tp in (int, float):
        if isinstance(value, bool):
            raise UserError(f"{where}: expected a number, got {value}")
        try:
            number = float(value) if tp is float else int(str(value))
        except ValueError:
            kind = "an integer" if tp is int else "a number"
            raise UserError(f"{where}: '{value}' is not {kind}") from None
        if not math.isfinite(number):
            raise UserError(f"{where}: '{value}' is not a finite number")
        if tp is int and abs(number) > _LARGEST_INTEGER:
            raise UserError(f"{where}: {value} is beyond the largest integer a run can use ({_LARGEST_INTEGER})")
        return number
    if tp in (str, Path):
        if "\0" in str(value):
            raise UserError(f"{where}: the value holds a NUL character (\\0), which no path or prompt can hold; "
                            "remove it")
        return tp(value)
    if tp is dict or typing.get_origin(tp) is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a table")
        return value
    raise TypeError(f"unsupported config type {tp!r} for {where}")


_LARGEST_INTEGER = 2**63 - 1  # torch's and numpy's int64, and SQLite's
_SCALARS = (str, int, float, bool, Path)  # a value that is neither an array nor a table (nor a TOML date)


def _wrong_kind(value: Any, tp: Any) -> bool:
    """A table, an array or a date where the field's type has no place for one (``learning_rate = {}``)."""
    origin = typing.get_origin(tp)
    if tp is dict or origin is dict:
        return False  # a table, checked with the type
    if origin in (list, tuple):  # an array, or one value as an array of one
        return not isinstance(value, (list, tuple, *_SCALARS))
    return not isinstance(value, _SCALARS)


def _kind(value: Any) -> str:
    """What a TOML value is, in TOML's words."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (list, tuple)):
        return "an array"
    return f"a {type(value).__name__} ({value})"


def _expected(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(c) for c in typing.get_args(tp))
    if origin in (list, tuple):
        return "an array"
    return {bool: "true or false", int: "an integer", float: "a number"}.get(tp, "a string")


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, sections: bool = False) -> None:
    """Add ``--config`` and one ``--<field>`` flag per dataclass field; with ``sections`` (a trainer's options),
    in the sections of :mod:`dreamstep.config.sections`, each under its title in ``--help``."""
    parser.add_argument("--config", metavar="TOML", default=argparse.SUPPRESS,
                        help="TOML file with any of the flags below as keys (command-line flags win)")
    fields = _fields(cls)
    groups: dict[str, Any] = {}
    for name in in_section_order(fields) if sections else fields:
        f, tp = fields[name]
        if sections and section_of(name) not in groups:
            groups[section_of(name)] = parser.add_argument_group(f"{section_of(name)} options")
        group = groups[section_of(name)] if sections else parser
        base, _ = _unwrap_optional(tp)
        default = f.default if f.default is not _MISSING else (
            f.default_factory() if f.default_factory is not _MISSING else None)
        help_text = f.metadata.get("help", "")
        if typing.get_origin(base) is Literal:
            help_text += f" {{{', '.join(str(c) for c in typing.get_args(base))}}}"
        if default not in (None, [], "") and "(default" not in help_text:
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.strip()}
        if base is bool:
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        elif typing.get_origin(base) in (list, tuple):
            # Repeating a list flag adds to it: --lora a.safetensors --lora b.safetensors:0.5
            kwargs.update(nargs="*", action="extend", metavar="VALUE")
        else:
            kwargs.update(metavar=name.upper())
        group.add_argument(f"--{name}", *(f"--{a}" for a in f.metadata.get("aliases", ())), **kwargs)


def build_config(cls: type[T], cli: dict[str, Any] | argparse.Namespace | None = None,
                 toml_path: str | Path | None = None) -> T:
    """Build ``cls`` from TOML values (strictly checked) overlaid by command-line values."""
    fields = _fields(cls)
    cli = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli or {})
    toml_path = toml_path or cli.pop("config", None)
    cli.pop("config", None)
    values: dict[str, Any] = {}
    aliases = {a: n for n, (f, _) in fields.items() for a in f.metadata.get("aliases", ())}
    for key, value in (load_toml(toml_path) if toml_path is not None else {}).items():
        key = aliases.get(key, key)
        if key not in fields:
            raise UserError(f"{toml_path}: unknown key '{key}'{did_you_mean(key, fields)}; "
                            f"see --help for the valid keys")
        where = f"{toml_path}: key '{key}'"
        values[key] = convert_value(value, fields[key][1], where, typed=True)
        check_bounds(values[key], fields[key][0].metadata.get("bounds"), where)
        _check_writable(values[key], where)
    for key, value in cli.items():
        if key in fields:
            values[key] = convert_value(value, fields[key][1], f"--{key}")
            check_bounds(values[key], fields[key][0].metadata.get("bounds"), f"--{key}")
            _check_writable(values[key], f"--{key}")
    missing = [n for n, (f, _) in fields.items()
               if n not in values and f.default is _MISSING and f.default_factory is _MISSING]
    if missing:
        raise UserError(f"--{missing[0]} is required (on the command line or as a key in --config)")
    return cls(**values)


def _check_writable(value: Any, where: str) -> None:
    """Refuse a value the run's saved settings (config.toml) could not record, before anything starts."""
    if value is None:
        return
    try:
        toml_value(value)
    except UnwritableValue as e:
        raise UserError(f"{where}: {e} (bytes the saved settings cannot record); give UTF-8 text, or rename the "
                        "file or folder") from None


def config_to_toml(config: Any) -> str:
    """Render a trainer's flat config dataclass as TOML (``None`` values are left out), for saving beside outputs:
    its options by section (:mod:`dreamstep.config.sections`), each section under a comment line."""
    values = {key: value for key, value in dataclasses.asdict(config).items() if value is not None}
    lines, section = [], None
    for key in in_section_order(values):
        if section_of(key) != section:
            section = section_of(key)
            lines += [""] * bool(lines) + [f"# {section}"]
        lines.append(f"{key} = {toml_value(values[key])}")
    return "\n".join(lines) + "\n"


class UnwritableValue(ValueError):
    """A value that TOML cannot hold."""


def toml_value(value: Any) -> str:
    """``value`` as TOML: a string as a basic string escaped as the TOML spec says (quotes, backslashes and
    every control character; other text as it is, the file being UTF-8). What TOML cannot hold (``None``
    inside a list or table, a string that is not text: a lone surrogate, which a command-line argument with
    bytes that are not UTF-8 decodes to) raises :class:`UnwritableValue`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # Python's float repr (1e-05, inf, nan) is TOML's float syntax too
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        raise UnwritableValue("TOML has no empty value")
    return _toml_string(str(value))


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_key(key: Any) -> str:
    """A table key: bare when TOML allows it, else quoted."""
    return key if isinstance(key, str) and _BARE_KEY.fullmatch(key) else _toml_string(str(key))


def _toml_string(text: str) -> str:
    parts = []
    for char in text:
        if char in _ESCAPES:
            parts.append(_ESCAPES[char])
        elif char < " " or char == "\x7f":
            parts.append(f"\\u{ord(char):04X}")
        elif "\ud800" <= char <= "\udfff":
            raise UnwritableValue(f"'{shown_text(text)}' is not valid UTF-8 text")
        else:
            parts.append(char)
    return '"' + "".join(parts) + '"'


def shown_text(text: str) -> str:
    """``text`` printable whatever it holds: the bytes of a lone surrogate (an argument that was not UTF-8)
    as ``\\xNN``."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no byte decodes to (from JSON's \\ud800)
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def refuse_unused(config: Any, names: tuple[str, ...], when: str) -> None:
    """Raise for the first of ``names`` set to a non-default value: a flag that would have no effect
    ``when`` (e.g. "with --dataset_config") is an error, never silently ignored."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name in names:
        if getattr(config, name) != defaults[name]:
            raise UserError(f"--{name} has no effect {when}; remove it")


def normalize_extension(extension: str | None) -> str | None:
    """``"txt"`` and ``".txt"`` both mean ``.txt`` (sd-scripts would look for ``imgtxt``)."""
    if extension is None or extension.startswith(".") or not extension:
        return extension or None
    return f".{extension}"


def check_option_groups(config: Any) -> None:
    """Run the checks of every option group ``config`` is composed of: each class of its MRO that defines its own
    ``check_group`` (the groups of :mod:`dreamstep.config.options`), base groups first. A training config calls
    this once at the end of its ``__post_init__``, so a group's checks run because it is composed, and no config
    can forget one."""
    for cls in reversed(type(config).__mro__):
        check = cls.__dict__.get("check_group")
        if check is not None:
            check(config)
