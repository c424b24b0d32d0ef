"""A training job as the browser or a script asks for it, checked before it is queued.

The options are checked by the trainer's own config dataclass (:func:`build_config`, as on the command
line). Every option that names a file or folder must name one inside the roots the dashboard was started
with: the run folders (outputs) and ``--data_root`` folders (datasets, models). Such a value is a path
relative to a root; absolute paths, ``..`` segments and symlinks that lead out of the root are refused. The
output folder is a root and a name, never an option.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dreamstep.config.schema import build_config, toml_value
from dreamstep.config.sections import in_section_order, section_of
from dreamstep.dashboard.heavy import import_heavy
from dreamstep.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["FieldError", "JobRequest", "check_job_request", "form_fields", "json_object", "named_field",
           "options_from_toml", "trainer_options"]

# Set by the dashboard itself: the output folder from the request's root and name, the resume by Resume.
SET_BY_DASHBOARD = ("output_dir", "resume_from_checkpoint", "resume", "config")
WRITTEN_PATHS = ("cache_dir", "logging_dir")
READ_PATHS = ("ae", "class_data_dir", "clip_l", "conditioning_data_dir", "dataset_config", "in_json",
              "instance_data_dir", "jsonl_for_train", "model_config", "network_weights", "reg_data_dir",
              "sample_prompts", "t5xxl", "train_data_dir", "transformer_single_file", "validation_data_dir",
              "validation_image")
# A local folder inside a root, or else a Hugging Face Hub id (owner/name).
MODEL_PATHS = ("pretrained_model_name_or_path", "controlnet_model_name_or_path", "clip_model", "dino_model",
               "dataset_name")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class FieldError(ValueError):
    """A refused request: ``field`` names the option (or ``trainer``, ``output_root``, ``name``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class JobRequest:
    """A checked job: its trainer, run folder, the TOML it will run and its config (the trainer's dataclass)."""

    trainer: str
    output_dir: Path
    config_toml: str
    config: Any


MAX_NAME = 100  # a run's folder name (file systems allow 255 bytes; the name is also shown in lists)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request's body as a JSON object, or :class:`FieldError` (``body``, or the key whose text is not
    writable): not JSON, nested deeper than the parser goes, not an object, or a lone surrogate (``\\ud800``),
    which no file or process argument can hold."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise FieldError("body", "the body is not JSON (or is nested too deeply)") from None
    if not isinstance(body, dict):
        raise FieldError("body", "the body must be a JSON object")
    pending: list[tuple[str, Any]] = [("body", body)]
    while pending:  # not recursive: the parser allows deeper nesting than Python's stack
        field, value = pending.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                name = key if field in ("body", "options") else field  # a top-level key or an option
                _unicode(key, name)
                pending.append((name, item))
        elif isinstance(value, list):
            pending.extend((field, item) for item in value)
        elif isinstance(value, str):
            _unicode(value, field)
    return body


def _unicode(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldError(field, f"{field}: the text holds a lone surrogate (not valid Unicode)") from None


def trainer_options(trainer: str) -> type:
    """The config dataclass of ``dreamstep train TRAINER``."""
    from dreamstep.cli import COMMANDS

    command = COMMANDS.get(("train", trainer))
    if command is None:
        names = ", ".join(key[1] for key in COMMANDS if key[0] == "train")
        raise FieldError("trainer", f"'{trainer}' is not a trainer; choose one of {names}")
    module, _, name = command.options.partition(":")
    return getattr(importlib.import_module(module), name)


def trainer_recipe(trainer: str) -> Any:
    """The recipe module of ``dreamstep train TRAINER``: what the dashboard asks of it (``FOLDER_FLAG``,
    ``training_datasets(config)``, ``plan_inputs(config, datasets, encodes_in_the_loop)``) is what its ``train``
    calls, so the form's dataset check and plan cannot disagree with the run."""
    from dreamstep.cli import COMMANDS

    trainer_options(trainer)  # an unknown trainer is a FieldError naming the known ones
    return import_heavy(COMMANDS[("train", trainer)].runner.partition(":")[0])


def check_job_request(body: Any, output_roots: list[Path], data_roots: list[Path]) -> JobRequest:
    """The job ``body`` asks for (``trainer``, ``output_root``: an index into the output roots, ``name``,
    ``options``: flag names without ``--`` and their values), or :class:`FieldError`."""
    if not isinstance(body, dict):
        raise FieldError("body", "the request must be a JSON object")
    trainer = str(body.get("trainer", ""))
    options_class = trainer_options(trainer)
    output_dir = _output_dir(body.get("output_root", 0), body.get("name"), output_roots)
    options = body.get("options", {})
    if not isinstance(options, dict):
        raise FieldError("options", "options must be a JSON object of flag names and values")
    names = {f.name for f in dataclasses.fields(options_class)}
    checked: dict[str, Any] = {}
    for key, value in options.items():
        if key in SET_BY_DASHBOARD:
            raise FieldError(key, f"--{key} is set by the dashboard (output root and name, or Resume); remove it")
        if key not in names:
            raise FieldError(key, f"--{key} is not an option of {trainer}")
        if value is None or value == "" or value == []:
            continue
        checked[key] = _checked_paths(key, value, output_dir, output_roots + data_roots)
    try:
        config = build_config(options_class, {**checked, "output_dir": str(output_dir)})
    except UserError as e:
        raise FieldError(named_field(str(e), names), str(e)) from None
    return JobRequest(trainer, output_dir, options_toml(config, checked), config)


def options_toml(config: Any, given: dict[str, Any]) -> str:
    """The TOML of the options given (as the config converted them); the trainer's defaults fill the rest."""
    return "".join(f"{key} = {toml_value(getattr(config, key))}\n" for key in given
                   if getattr(config, key) is not None)


def named_field(message: str, names: set[str]) -> str:
    """The option a trainer's error message names (its first ``--flag`` among ``names``), else ``options``."""
    found = re.search(r"--(\w+)", message)
    return found.group(1) if found and found.group(1) in names else "options"


def _output_dir(root_index: Any, name: Any, roots: list[Path]) -> Path:
    if not isinstance(root_index, int) or not 0 <= root_index < len(roots):
        raise FieldError("output_root", f"output_root must be a number from 0 to {len(roots) - 1} "
                                        "(the run folders the dashboard was started with)")
    if not isinstance(name, str) or not re.fullmatch(rf"[A-Za-z0-9][\w.-]{{0,{MAX_NAME - 1}}}", name):
        raise FieldError("name", f"the run's name must be one folder name of at most {MAX_NAME} letters, digits, "
                                 "'_', '-' and '.', not starting with '.'; it is made inside the output root")
    return _inside([roots[root_index]], name, "name", must_exist=False)


def _checked_paths(key: str, value: Any, output_dir: Path, roots: list[Path]) -> Any:
    if key not in WRITTEN_PATHS + READ_PATHS + MODEL_PATHS:
        return value
    if isinstance(value, list):
        return [_checked_path(key, item, output_dir, roots) for item in value]
    return _checked_path(key, value, output_dir, roots)


def _checked_path(key: str, value: Any, output_dir: Path, roots: list[Path]) -> str:
    text = str(value)
    if key in WRITTEN_PATHS:
        return str(_inside([output_dir.parent], text, key, must_exist=False))
    if key in MODEL_PATHS and _HUB_ID.fullmatch(text) and not _found_in(roots, text):
        return text
    return str(_inside(roots, text, key, must_exist=True))


def _found_in(roots: list[Path], relative: str) -> bool:
    return any((root / relative).exists() for root in roots)


def _inside(roots: list[Path], relative: str, key: str, *, must_exist: bool) -> Path:
    """The real path of ``relative`` under the first of ``roots`` where it lies (and exists, if it must)."""
    if not relative or os.path.isabs(relative) or relative.startswith("~") or "\\" in relative:
        raise FieldError(key, f"--{key} {relative}: give a path relative to a folder the dashboard serves; "
                              "absolute paths are refused")
    if ".." in relative.split("/"):
        raise FieldError(key, f"--{key} {relative}: '..' is refused; give a path inside a served folder")
    for root in roots:
        real_root = Path(os.path.realpath(root))
        candidate = Path(os.path.realpath(real_root / relative))
        if candidate != real_root and real_root not in candidate.parents:
            raise FieldError(key, f"--{key} {relative}: leads outside {root} (through a symlink); refused")
        if candidate.exists() or not must_exist:
            return candidate
    shown = ", ".join(str(r) for r in roots)
    raise FieldError(key, f"--{key} {relative}: not found in {shown}")


# The new-run page's sections, in order; a flag goes to the first whose pattern matches its name.
def form_fields(trainer: str) -> list[dict[str, Any]]:
    """Every option of ``trainer`` as the new-run page shows it: its section, kind, choices, default and help
    (the texts of ``--help``); those the dashboard sets itself are left out."""
    from dreamstep.config.schema import _fields, _unwrap_optional

    shown = []
    fields = _fields(trainer_options(trainer))
    for name in in_section_order(fields):
        f, tp = fields[name]
        if name in SET_BY_DASHBOARD:
            continue
        base, optional = _unwrap_optional(tp)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown.append({"name": name, "group": section_of(name),
                      "kind": _kind(base), "choices": [str(c) for c in typing.get_args(base)]
                      if typing.get_origin(base) is Literal else None,
                      "default": default, "required": required, "help": f.metadata.get("help", ""),
                      "path": name in WRITTEN_PATHS + READ_PATHS + MODEL_PATHS})
    return shown


def _kind(base: Any) -> str:
    if typing.get_origin(base) is Literal:
        return "choice"
    if typing.get_origin(base) in (list, tuple):
        return "list"
    return {bool: "bool", int: "int", float: "float"}.get(base, "text")


def options_from_toml(trainer: str, text: str, roots: list[Path]) -> dict[str, Any]:
    """The options of a TOML (a run's ``config.toml`` or a user's file) for the form: the dashboard's own
    keys left out, paths inside a root made relative to it (others stay, for the check to refuse)."""
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise FieldError("toml", f"not valid TOML: {e}") from None
    names = {f.name for f in dataclasses.fields(trainer_options(trainer))}
    options = {}
    for key, value in values.items():
        if key in SET_BY_DASHBOARD:
            continue
        if key not in names:
            raise FieldError("toml", f"key '{key}' is not an option of {trainer}")
        paths = WRITTEN_PATHS + READ_PATHS + MODEL_PATHS
        options[key] = _relative(value, roots) if key in paths and isinstance(value, str) else value
    return options


def _relative(value: str, roots: list[Path]) -> str:
    if not os.path.isabs(value):
        return value
    real = Path(os.path.realpath(value))
    for root in roots:
        real_root = Path(os.path.realpath(root))
        if real == real_root or real_root in real.parents:
            return real.relative_to(real_root).as_posix() or "."
    return value
