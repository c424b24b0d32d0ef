"""Qwen-Image DreamBooth LoRA: ``dreamstep train qwen-image-lora``."""

from __future__ import annotations

from typing import Any

import torch

from dreamstep.models.qwen_image.step import QwenImageFlowMatchingStep


class QwenImageLoraStep(QwenImageFlowMatchingStep):
    """diffusers' DreamBooth LoRA step: the transformer predicts the velocity of the target's tokens."""

    def predict(self, model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, Any],
                condition: None) -> torch.Tensor:
        return model(**inputs, return_dict=False)[0]
