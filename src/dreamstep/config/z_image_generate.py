"""Options of ``dreamstep generate z-image``: the shared generation flags; Z-Image's defaults follow the model
(Turbo: 9 steps without guidance; the base: 50 steps at guidance 4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dreamstep.config.generate import GenerateConfig


@dataclass
class ZImageGenerateConfig(GenerateConfig):
    model_type: ClassVar[str] = "z-image"
    lora_model: ClassVar[str] = "z-image"
    size_multiple: ClassVar[int] = 16  # the VAE's 8x and the transformer's 2x2 patches

