"""Helpers that write small real image files for the data tests."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def write_image(path: Path, size: tuple[int, int], color=(200, 30, 30), mode: str = "RGB") -> Path:
    """An image of ``size`` (w, h) filled with ``color``; the format follows the suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)
    return path


def write_gradient(path: Path, size: tuple[int, int]) -> Path:
    """An image whose red channel encodes x and green encodes y, so crops and flips can be checked."""
    w, h = size
    image = Image.new("RGB", size)
    image.putdata([(x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), 0) for y in range(h) for x in range(w)])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
