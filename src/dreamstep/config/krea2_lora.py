"""Options of ``dreamstep train krea2-lora``: the flags of diffusers' ``train_dreambooth_lora_krea2.py`` (instance /
class images, LoRA shape and layers, the flow-matching weighting, ``--validation_model_path`` for the Turbo
checkpoint that draws the validation samples while the LoRA trains on RAW), as z-image-lora has them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dreamstep.config.schema import option
from dreamstep.config.z_image_lora import ZImageLoraConfig


@dataclass
class Krea2LoraConfig(ZImageLoraConfig):
    model_title: ClassVar[str] = "Krea 2"

    pretrained_model_name_or_path: str = option(
        help="the Krea 2 base to train on: a diffusers folder or hub id (krea/Krea-2-Raw; a LoRA trained on the "
             "distilled Turbo breaks its distillation)")
    validation_model_path: Optional[str] = option(
        None, "draw the validation samples with this Krea 2 checkpoint's transformer and scheduler (a folder or hub "
              "id, e.g. krea/Krea-2-Turbo) carrying the LoRA being trained; default: the base")
    validation_inference_steps: Optional[int] = option(  # type: ignore[assignment]
        None, "denoising steps of the validation samples (default: 8 for Turbo, 28 for RAW)", bounds="[1, inf)")
    validation_guidance_scale: Optional[float] = option(
        None, "classifier-free guidance of the validation samples (default: 0 for Turbo, 4.5 for RAW)",
        bounds="[0, inf)")
