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
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamstep.config.schema import build_config, toml_value
from dreamstep.errors import UserError

__all__ = ["FieldError", "JobRequest", "check_job_request", "trainer_options"]

# Set by the dashboard itself: the output folder from the request's root and name, the resume by Resume.
SET_BY_DASHBOARD = ("output_dir", "resume_from_checkpoint", "resume", "config")
WRITTEN_PATHS = ("cache_dir", "logging_dir")
READ_PATHS = ("class_data_dir", "conditioning_data_dir", "dataset_config", "in_json", "instance_data_dir",
              "jsonl_for_train", "model_config", "network_weights", "reg_data_dir", "sample_prompts",
              "train_data_dir", "transformer_single_file", "validation_data_dir", "validation_image")
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
    trainer: str
    output_dir: Path
    config_toml: str


def trainer_options(trainer: str) -> type:
    """The config dataclass of ``dreamstep train TRAINER``."""
    from dreamstep.cli import COMMANDS

    command = COMMANDS.get(("train", trainer))
    if command is None:
        names = ", ".join(key[1] for key in COMMANDS if key[0] == "train")
        raise FieldError("trainer", f"'{trainer}' is not a trainer; choose one of {names}")
    module, _, name = command.options.partition(":")
    return getattr(importlib.import_module(module), name)


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
        raise FieldError(_named_field(str(e), names), str(e)) from None
    return JobRequest(trainer, output_dir, options_toml(config, checked))


def options_toml(config: Any, given: dict[str, Any]) -> str:
    """The TOML of the options given (as the config converted them); the trainer's defaults fill the rest."""
    return "".join(f"{key} = {toml_value(getattr(config, key))}\n" for key in given
                   if getattr(config, key) is not None)


def _named_field(message: str, names: set[str]) -> str:
    found = re.search(r"--(\w+)", message)
    return found.group(1) if found and found.group(1) in names else "options"


def _output_dir(root_index: Any, name: Any, roots: list[Path]) -> Path:
    if not isinstance(root_index, int) or not 0 <= root_index < len(roots):
        raise FieldError("output_root", f"output_root must be a number from 0 to {len(roots) - 1} "
                                        "(the run folders the dashboard was started with)")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name):
        raise FieldError("name", "the run's name must be one folder name of letters, digits, '_', '-' and '.', "
                                 "not starting with '.'; it is made inside the output root")
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
