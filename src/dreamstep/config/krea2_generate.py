"""Options of ``dreamstep generate krea2``: the shared generation flags; Krea 2's defaults follow the model (Turbo:
8 steps without guidance; RAW: 28 steps at 4.5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dreamstep.config.generate import GenerateConfig


@dataclass
class Krea2GenerateConfig(GenerateConfig):
    model_type: ClassVar[str] = "krea2"
    lora_model: ClassVar[str] = "krea2"
    size_multiple: ClassVar[int] = 16  # Qwen-Image's VAE's 8x and the transformer's 2x2 patches
