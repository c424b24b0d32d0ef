"""Frozen encoders parked off the training device while the loop runs.

Once every caption and image of a run is encoded into the caches, the text encoders (T5-XXL alone is
9.5 GB in bf16) and the VAE have nothing to do until validation or the end of the run. They wait in CPU
memory and come back to the device only inside :meth:`ParkedModules.on_device`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

# Where parked modules wait. Tests point it at the meta device, where any use of a parked module fails.
PARKING_DEVICE = torch.device("cpu")


class ParkedModules:
    """Modules that live on :data:`PARKING_DEVICE` except inside :meth:`on_device`."""

    def __init__(self, modules: dict[str, nn.Module], device: torch.device):
        self.modules = modules
        self.device = device

    def park(self) -> None:
        for module in self.modules.values():
            module.to(PARKING_DEVICE)
        if self.modules and self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back so the loop's activations can use them

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Bring the modules to the training device for the block (validation, class images)."""
        for module in self.modules.values():
            module.to(self.device)
        try:
            yield
        finally:
            self.park()

    def describe(self) -> str:
        return ", ".join(self.modules) if self.modules else "none"
