"""Every option of every ``train`` command (found in the command table, not listed here) does something or is
refused in one line. A real one-step run of each trainer on its tiny model records which options the run reads
once its config is built; an option the run never reads must be refused, in one line naming it, when it is given a
value other than its default."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT

from dreamstep.cli import COMMANDS
from dreamstep.config.schema import build_config
from dreamstep.errors import UserError
from dreamstep.models.family import families

TRAINERS = [key[1] for key in COMMANDS if key[0] == "train"]
# sd-scripts flags kept so its command lines run as written, whose behaviour is dreamstep's in any case.
SAME_EITHER_WAY = {
    ("flux-kohya", "sdpa"): "FLUX's attention is PyTorch's scaled-dot-product attention",
    ("flux-kohya", "persistent_data_loader_workers"): "sd-scripts' documented command gives it without workers, "
                                                      "where sd-scripts ignores it too",
}
# Reads that only copy or describe every field (config.toml, dataclasses.replace) are not uses.
_NOT_USES = ("dreamstep/config/schema.py", "/dataclasses.py")


def dataset_toml(root: Path, image_dir: Path = ROBOT_DIR, extra: str = "", conditioning: bool = False) -> Path:
    """``root/dataset.toml``: one subset of ``image_dir`` (its own conditioning images too, with ``conditioning``)
    at 32 px, ``extra`` lines added to the subset."""
    subset = f"image_dir = '{image_dir.as_posix()}'\nclass_tokens = '{ROBOT_PROMPT}'\n{extra}"
    if conditioning:
        subset += f"conditioning_data_dir = '{image_dir.as_posix()}'\n"
    toml = root / "dataset.toml"
    toml.write_text("[general]\nenable_bucket = false\n\n[[datasets]]\nresolution = 32\nbatch_size = 1\n\n"
                    f"  [[datasets.subsets]]\n{subset}")
    return toml


def _smallest_run(trainer: str, models: dict[str, Path], root: Path) -> dict[str, str]:
    """The options of a one-step run of ``trainer`` on its tiny model: FLUX.1's and SDXL's here, another family's
    from its testkit (``tests/recipes/<package>_testkit.py``: ``smallest_run(trainer, root)``)."""
    out = {"output_dir": str(root / "out"), "max_train_steps": "1"}
    flux = {**out, "pretrained_model_name_or_path": str(models["flux"]), "resolution": "32", "report_to": "none",
            "checkpointing_steps": "0"}
    kohya = {**out, "dataset_config": str(dataset_toml(root)), "log_with": "none"}
    runs = {
        "flux-lora": {**flux, "instance_data_dir": str(ROBOT_DIR), "instance_prompt": ROBOT_PROMPT},
        "flux-kontext-lora": {**flux, "instance_data_dir": str(ROBOT_DIR), "conditioning_data_dir": str(ROBOT_DIR),
                              "instance_prompt": ROBOT_PROMPT},
        "flux-controlnet": {**flux, "train_data_dir": str(ROBOT_DIR), "conditioning_data_dir": str(ROBOT_DIR),
                            "default_caption": ROBOT_PROMPT, "num_double_layers": "1", "num_single_layers": "1"},
        "flux-kohya": {**kohya, "pretrained_model_name_or_path": str(models["flux"]),
                       "network_module": "networks.lora_flux", "network_dim": "4"},
        "sdxl-lora": {**kohya, "pretrained_model_name_or_path": str(models["sdxl"]), "network_dim": "4"},
    }
    if trainer in runs:
        return runs[trainer]
    family = next(f for f in families().values() if ("train", trainer) in f.commands)
    package = type(family).__module__.split(".")[-2]
    try:
        testkit = importlib.import_module(f"{package}_testkit")
    except ModuleNotFoundError:
        pytest.fail(f"train {trainer}: write tests/recipes/{package}_testkit.py with smallest_run(trainer, root), "
                    "the options of a one-step run on the family's tiny model")
    return testkit.smallest_run(trainer, root)


def _recipe(trainer: str) -> tuple[type, types.ModuleType]:
    command = COMMANDS[("train", trainer)]
    module, _, name = command.options.partition(":")
    return getattr(importlib.import_module(module), name), importlib.import_module(command.runner.partition(":")[0])


def _tracking(config: Any, read: set[str]) -> Any:
    """``config`` as an instance of a subclass that records the fields read through it (outside _NOT_USES)."""
    fields = {f.name for f in dataclasses.fields(config)}
    base = type(config)

    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807 (the hook's own name)
        if name in fields and not sys._getframe(1).f_code.co_filename.endswith(_NOT_USES):
            read.add(name)
        return base.__getattribute__(self, name)

    config.__class__ = type(f"Tracking{base.__name__}", (base,), {"__getattribute__": __getattribute__})
    return config


def _other_value(field: dataclasses.Field, kind: Any) -> Any:
    """A value of the field's type (``kind``) other than its default, as a command line gives it."""
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    choices = typing.get_args(kind)
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, int):
        return str(default + 1)
    if isinstance(default, float):
        return str(default / 2 if default else 0.5)
    if isinstance(default, list):
        return ["x"]
    literal = [c for c in choices if isinstance(c, str) and c != default]
    return literal[0] if literal else "x"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_option_does_something_or_is_refused(trainer: str, tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path,
                                                   tmp_path: Path) -> None:
    options_class, recipe = _recipe(trainer)
    values = _smallest_run(trainer, {"flux": tiny_flux_dev_dir, "sdxl": tiny_sdxl_dir}, tmp_path)
    read: set[str] = set()
    recipe.train(_tracking(build_config(options_class, dict(values)), read))
    silent = []
    kinds = typing.get_type_hints(options_class)
    for field in dataclasses.fields(options_class):
        if field.name in read or field.name in values or (trainer, field.name) in SAME_EITHER_WAY:
            continue
        given = {**values, field.name: _other_value(field, kinds[field.name]), "dry_run": "true",
                 "output_dir": str(tmp_path / "dry" / field.name)}
        try:  # refused when the config is built, or by the run's checks before anything loads
            recipe.train(build_config(options_class, given))
        except UserError as error:
            assert "\n" not in str(error) and field.name in str(error), (field.name, str(error))
            continue
        silent.append(field.name)
    assert silent == [], f"train {trainer}: options that neither change the run nor are refused: {silent}"
