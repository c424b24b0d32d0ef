"""Options of ``dreamstep generate qwen-image`` and ``generate qwen-image-edit``: the shared generate flags, Qwen's
true classifier-free guidance, and an edit's one to three reference images."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dreamstep.config.generate import GenerateConfig
from dreamstep.config.schema import option
from dreamstep.errors import UserError

# Qwen-Image-Edit-Plus reads up to three reference images.
MAX_REFERENCE_IMAGES = 3


@dataclass
class QwenImageGenerateConfig(GenerateConfig):
    """Qwen-Image samples with true classifier-free guidance (two transformer passes per step) when a negative
    prompt is given."""

    model_type: ClassVar[str] = "qwen-image"
    lora_model: ClassVar[str] = "qwen-image"
    size_multiple: ClassVar[int] = 16

    true_cfg_scale: float = option(4.0, "classifier-free guidance with --negative_prompt (the pipelines' default "
                                        "4; 1 turns it off)", bounds="[1, inf)", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.guidance_scale is not None:
            raise UserError("--guidance_scale: Qwen-Image is not guidance-distilled; use --true_cfg_scale with "
                            "--negative_prompt")

    def call_kwargs(self) -> dict[str, Any]:
        return {"true_cfg_scale": self.true_cfg_scale}


@dataclass
class QwenImageEditGenerateConfig(QwenImageGenerateConfig):
    """Qwen-Image-Edit edits --image (one to three references) as --prompt says."""

    model_type: ClassVar[str] = "qwen-image-edit"

    image: list[str] = option(help="the image(s) to edit or combine: one to three paths", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= len(self.image) <= MAX_REFERENCE_IMAGES:
            raise UserError(f"--image: give one to {MAX_REFERENCE_IMAGES} images (got {len(self.image)})")
