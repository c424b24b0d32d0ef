"""Qwen2.5-VL's text-and-image processor without torchvision, for Qwen-Image-Edit's prompt encoding.

transformers' ``Qwen2VLProcessor`` holds a video processor, and the video processors import torchvision; without it
the processor cannot be built (``VIDEO_PROCESSOR_MAPPING`` has no entry), so ``QwenImageEditPipeline`` cannot load
its ``processor``. Edit prompts carry images, never videos: :class:`ImageTextProcessor` is transformers' own
processor (its ``__call__``: image patches, ``<|image_pad|>`` expanded to the image's merged patch count, the
tokenizer) built from the image processor and the tokenizer alone, with the PIL image processor
(``Qwen2VLImageProcessorPil``), which needs no torchvision either. The Edit trainers and the tiny Edit model pass it
to the pipeline as ``processor=``; where torchvision is installed the pipeline's own processor gives the same
inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Qwen2Tokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor


class ImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` over an image processor and a tokenizer (no video processor)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)


def image_text_processor(folder: str | Path, *, revision: str | None = None) -> ImageTextProcessor:
    """The processor of a Qwen-Image-Edit folder (or hub id): its ``processor/`` image processor settings and the
    ``tokenizer/`` it shares with the text-to-image pipeline."""
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder, subfolder="processor", revision=revision)
    tokenizer = Qwen2Tokenizer.from_pretrained(folder, subfolder="tokenizer", revision=revision)
    return ImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer)
