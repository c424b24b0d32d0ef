"""Options of ``dreamstep generate flux2-klein`` and ``generate flux2``: the shared generate flags, and reference
images to edit from (``--image``, one or several)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dreamstep.config.generate import GenerateConfig
from dreamstep.config.schema import option
from dreamstep.errors import UserError


@dataclass
class Flux2KleinGenerateConfig(GenerateConfig):
    """FLUX.2 [klein]: text to image, or an edit of the reference images; --negative_prompt steers a base model's
    classifier-free guidance (--guidance_scale > 1)."""

    model_type: ClassVar[str] = "flux2-klein"
    lora_model: ClassVar[str] = "flux2"
    size_multiple: ClassVar[int] = 16

    image: list[str] = option([], "reference images the prompt edits (several: each its own tokens, in order); the "
                                  "image is generated at the first one's size unless --width / --height say")

    def sized_to_image(self, image_size: tuple[int, int]) -> tuple[int, int] | None:
        return max(16, image_size[0] // 16 * 16), max(16, image_size[1] // 16 * 16)


@dataclass
class Flux2GenerateConfig(Flux2KleinGenerateConfig):
    """FLUX.2 [dev]: guidance-distilled (--guidance_scale is the distilled guidance), so no negative prompt."""

    model_type: ClassVar[str] = "flux2"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.negative_prompt:
            raise UserError("--negative_prompt: FLUX.2 [dev] is guidance-distilled and samples without one; remove it")
