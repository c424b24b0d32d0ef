"""The base model a run trained on, as the local diffusers folder whose configs its LoRA files are checked
against (``fits:`` in the adapter panel): a run on a tiny or fine-tuned model is checked against that model, not
the released one, however its config names the base.

A run's ``config.toml`` keeps paths as they were typed: relative ones are relative to the folder the run was
started in, which its relative ``output_dir`` tells (the run folder without it); the dashboard's own folder is
tried next. A single file (an SDXL checkpoint, a FLUX transformer file) finds its configs in ``model_config`` or
in its own folder, as the trainers do.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["run_base"]

# In the order the trainers read the base's configs from.
_BASE_KEYS = ("model_config", "pretrained_model_name_or_path", "transformer_single_file")


def run_base(config: dict[str, Any], run_folder: Path) -> str | None:
    """The diffusers folder (with ``model_index.json``) of the run's base, or ``None`` (a hub id, or not found
    here): the released model's shapes are then the reference."""
    started_in = _started_in(config.get("output_dir"), run_folder)
    for key in _BASE_KEYS:
        value = config.get(key)
        if not isinstance(value, str) or not value:
            continue
        for place in _candidates(Path(value).expanduser(), started_in):
            folder = place.parent if place.is_file() else place
            if (folder / "model_index.json").is_file():
                return str(folder)
    return None


def _started_in(output_dir: Any, run_folder: Path) -> Path | None:
    """The folder the run was started in: the run folder less its relative ``output_dir`` (``out/robot`` of
    ``/home/me/out/robot`` gives ``/home/me``); ``None`` where that does not add up."""
    if not isinstance(output_dir, str) or not output_dir or Path(output_dir).is_absolute():
        return None
    parts = [p for p in PurePosixPath(output_dir.replace("\\", "/")).parts if p != "."]
    folder = run_folder.resolve()
    if ".." in parts or not parts or list(folder.parts[-len(parts):]) != parts:
        return None
    return Path(*folder.parts[:-len(parts)])


def _candidates(path: Path, started_in: Path | None) -> list[Path]:
    if path.is_absolute():
        return [path]
    return ([started_in / path] if started_in is not None else []) + [Path.cwd() / path]
