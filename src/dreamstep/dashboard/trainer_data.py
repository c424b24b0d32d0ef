"""What a trainer reads as its data, from its own config: the data code its recipe calls, so that the dataset
check shows what that trainer will train on (square crops or buckets, its caption rules, the instance prompt of
images without a caption file, its defaults), for ``dashboard --dataset`` and the new-run form alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dreamstep.config.schema import build_config, load_toml
from dreamstep.dashboard.job_requests import trainer_options, trainer_recipe
from dreamstep.data.dataset_config import DatasetConfig, load_dataset_config
from dreamstep.errors import UserError

__all__ = ["check_config", "folder_flag", "trainer_datasets"]

# Required options the data does not depend on: set where the config leaves them out.
_PLACEHOLDERS = {"pretrained_model_name_or_path": ".", "output_dir": "."}


def trainer_datasets(trainer: str, config: Any) -> list[DatasetConfig]:
    """The datasets ``dreamstep train TRAINER`` builds from ``config`` (its config dataclass): its recipe's own
    ``training_datasets``; a mistake raises the trainer's UserError."""
    return trainer_recipe(trainer).training_datasets(config)


def folder_flag(trainer: str) -> str:
    """The flag ``dreamstep train TRAINER`` reads an image folder from (a file given instead is its
    --dataset_config)."""
    return trainer_recipe(trainer).FOLDER_FLAG


def check_config(trainer: str, data: str | Path | None = None, config_toml: str | Path | None = None,
                 **flags: Any) -> Any:
    """The config of ``train TRAINER`` for a dataset check: its ``--config`` TOML (e.g. a run's config.toml), then
    ``data`` (an image folder, read with the trainer's folder flag, or a dataset TOML), then ``flags`` (given
    values as on its command line; ``None`` leaves one out). Options the data does not need (the model, the
    output folder) get placeholders where missing. Bad values raise the trainer's own UserError."""
    options_class = trainer_options(trainer)
    names = set(options_class.__dataclass_fields__)
    from_toml = load_toml(config_toml) if config_toml is not None else {}
    values: dict[str, Any] = {k: v for k, v in _PLACEHOLDERS.items() if k not in from_toml}
    if data is not None:
        path = Path(data)
        if not path.exists():
            raise UserError(f"--dataset {path}: no such file or folder; give a dataset TOML or an image folder")
        folder = folder_flag(trainer)
        values.update({"dataset_config": None, folder: None})
        values["dataset_config" if path.is_file() else folder] = str(path)
        if path.is_file() and "masked_loss" not in from_toml and "masked_loss" in names:
            # A TOML that gives masks is read as --masked_loss reads it, and the check shows the masks.
            values["masked_loss"] = str(_declares_masks(path))
    for flag, value in flags.items():
        if value is None:
            continue
        if flag not in names:
            raise UserError(f"--{flag} is not an option of 'dreamstep train {trainer}'; remove it, or pick the "
                            "trainer that has it with --trainer")
        values[flag] = str(value)
    return build_config(options_class, values, toml_path=config_toml)


def _declares_masks(toml: Path) -> bool:
    """Whether a dataset TOML gives masks (alpha_mask, or masks in conditioning_data_dir)."""
    datasets = load_dataset_config(toml, cli={"resolution": 1024})
    return any(s.alpha_mask or s.conditioning_data_dir is not None for d in datasets for s in d.subsets)
