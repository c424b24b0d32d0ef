"""Tiny random captioners, written once a session as ``dreamstep tiny-model captioners`` writes them."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_captioners(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder that holds florence2/, blip/, llava/ and wd14/ (tests must not write into it)."""
    from dreamstep.captioning.tiny import write_tiny_blip, write_tiny_florence2, write_tiny_llava, write_tiny_wd14

    out = tmp_path_factory.mktemp("captioners")
    for write in (write_tiny_florence2, write_tiny_blip, write_tiny_llava, write_tiny_wd14):
        write(out, seed=0)
    return out
