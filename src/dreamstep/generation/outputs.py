"""Generated images on disk: ``<index>-<seed>.png`` with the generation parameters in PNG text chunks
(:mod:`dreamstep.png_text`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from PIL import Image

from dreamstep.files import atomic_path
from dreamstep.png_text import png_info

_NAME = re.compile(r"^(\d+)-")


def next_index(output_dir: Path) -> int:
    """The first index after every ``<index>-*.png`` already in ``output_dir``: earlier images stay."""
    taken = [int(m.group(1)) for p in output_dir.glob("*.png") if (m := _NAME.match(p.name))]
    return max(taken, default=-1) + 1


def save_png(image: Image.Image, output_dir: Path, index: int, params: dict[str, Any]) -> Path:
    """Write ``<index:05d>-<seed>.png`` atomically (a temporary file renamed into place)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"{index:05d}-{params['seed']}.png"
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG", pnginfo=png_info(params))
    return path
