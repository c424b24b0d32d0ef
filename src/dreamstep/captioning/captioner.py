"""What the caption loop needs of a captioner, and which module loads each: the WD14 tagger needs onnxruntime
and no torch (:mod:`.tagger`), the others transformers (:mod:`.models`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from dreamstep.config.caption import CaptionConfig


@dataclass
class Captioner:
    """``caption(images) -> captions``; ``tags``: whether a caption is a comma-separated tag list."""

    name: str
    caption: Callable[[list[Image.Image]], list[str]]
    tags: bool = False
    device: str = "cpu"
    dtype: str = "fp32"


def load_captioner(config: CaptionConfig) -> Captioner:
    """The captioner ``config`` names, loaded on its device; a model that cannot be had is one UserError line."""
    if config.captioner == "wd14":
        from dreamstep.captioning.tagger import load_tagger

        return load_tagger(config)
    from dreamstep.captioning.models import load_transformers_captioner

    return load_transformers_captioner(config)


def unavailable_reason(error: Exception) -> str:
    """Why a model could not be had, in words: offline and not cached, or the loader's first line."""
    text = str(error).strip()
    if "offline" in text.lower() or "connect" in text.lower() or "cache" in text.lower():
        return "it is not in the local Hugging Face cache and the hub is offline or unreachable"
    return text.splitlines()[0] if text else type(error).__name__
