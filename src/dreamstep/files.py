"""Writing files so that a crash never leaves half of one where a whole one was: each is written under a
temporary name beside its target (same folder, so same file system) and renamed into place, which
replaces the target in one step. Temporary names carry the process id, so processes writing the same
target do not write into each other's files."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends without an error it replaces
    ``path``, otherwise it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def atomic_files(folder: str | Path) -> Iterator[Path]:
    """A temporary folder inside ``folder`` for a library that writes files by name (``save_pretrained``);
    when the block ends without an error each file in it replaces its namesake in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".saving-") as tmp:
        yield Path(tmp)
        for file in sorted(Path(tmp).iterdir()):
            os.replace(file, folder / file.name)
