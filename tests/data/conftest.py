"""Small real image files for the data tests (written with Pillow into tmp_path)."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_testkit import write_image


@pytest.fixture
def image_folder(tmp_path: Path):
    """Build a folder of images: ``image_folder("name", {"a.png": (w, h), ...}, captions={...})``."""

    def build(name: str, sizes: dict[str, tuple[int, int]], captions: dict[str, str] | None = None,
              extension: str = ".caption") -> Path:
        folder = tmp_path / name
        for file_name, size in sizes.items():
            write_image(folder / file_name, size)
        for stem, text in (captions or {}).items():
            (folder / f"{stem}{extension}").write_text(text, encoding="utf-8")
        return folder

    return build
