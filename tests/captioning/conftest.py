"""Tiny random captioners, written once a session by ``dreamstep tiny-model captioners``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dreamstep.captioning.tiny import FOLDERS
from dreamstep.cli import main


@pytest.fixture(scope="session")
def tiny_captioners(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder that holds florence2/, blip/, qwen2_5_vl/, llava/ and wd14/ (tests must not write into it)."""
    out = tmp_path_factory.mktemp("tiny") / "captioners"
    assert main(["tiny-model", "captioners", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FOLDERS)
    return out
