"""Writing a Kohya LoRA network the way sd-scripts does: step files ``<name>-step00000500.<ext>``, epoch
files ``<name>-000001.<ext>`` when due, the final ``<name>.<ext>``, each with the run's ``ss_*`` metadata
and the epoch and step it was written at."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class SaveSchedule:
    """When sd-scripts writes intermediate files (``--save_every_n_steps`` / ``--save_every_n_epochs``)."""

    every_n_steps: int | None
    every_n_epochs: int | None
    steps_per_epoch: int
    total_steps: int

    def suffix(self, global_step: int) -> str | None:
        """``-000002`` at an epoch boundary that is due, ``-step00000500`` at a due step, else None."""
        if self.every_n_epochs and global_step % (self.every_n_epochs * self.steps_per_epoch) == 0:
            return f"-{global_step // self.steps_per_epoch:06d}"
        if self.every_n_steps and global_step % self.every_n_steps == 0:
            return f"-step{global_step:08d}"
        return None


@dataclass
class KohyaLoraWriter:
    """Saves ``network`` (anything with ``save_weights(path, dtype, metadata)``) into ``folder``."""

    network: Any
    folder: Path
    name: str
    extension: str
    schedule: SaveSchedule
    dtype: torch.dtype | None
    metadata: dict[str, str]
    saved: list[Path] = field(default_factory=list)

    def due(self, global_step: int) -> bool:
        return self.schedule.suffix(global_step) is not None

    def maybe_save(self, global_step: int) -> None:
        """Write the intermediate file due at ``global_step`` (the last step only gets the final file)."""
        suffix = self.schedule.suffix(global_step)
        if suffix is not None and global_step < self.schedule.total_steps:
            self.saved.append(self.save(global_step, suffix))

    def save(self, global_step: int, suffix: str = "") -> Path:
        steps_per_epoch = self.schedule.steps_per_epoch
        metadata = {**self.metadata, "ss_steps": str(global_step),
                    "ss_epoch": str(math.ceil(global_step / steps_per_epoch)),
                    "ss_num_epochs": str(math.ceil(self.schedule.total_steps / steps_per_epoch)),
                    "ss_training_finished_at": str(time.time())}
        return self.network.save_weights(self.folder / f"{self.name}{suffix}.{self.extension}", self.dtype, metadata)
