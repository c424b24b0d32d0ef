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
