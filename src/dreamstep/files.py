"""Writing files so that a crash never leaves half of one where a whole one was, with the permissions a
plain ``open()`` would give.

Each file is written under a temporary name beside its target (same folder, so same file system) and
renamed into place, which replaces the target in one step. Temporary names carry the process id, so
processes writing the same target do not write into each other's files.

safetensors (and so diffusers' ``save_pretrained``) and ``tempfile.mkstemp`` create files with mode 0600,
whatever the umask: a LoRA written that way cannot be read by another account, such as the one a
ComfyUI server runs under. Everything written through this module gets the umask's mode.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dreamstep.errors import UserError


def default_file_mode() -> int:
    """0666 less the process umask, as for a file created with ``open()``."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def honour_umask(path: str | Path) -> None:
    """Give ``path`` (a file, or every file under a folder) the mode :func:`default_file_mode` gives."""
    path = Path(path)
    mode = default_file_mode()
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for file in files:
        os.chmod(file, mode)


_TEMPORARY = re.compile(r"^\..+\.(\d+)\.tmp$")


def temporary_file_owner(path: Path) -> int | None:
    """The process id in the name of a temporary file :func:`atomic_path` made (``None`` for other names): a
    process killed while it wrote one (kill -9) leaves it behind."""
    match = _TEMPORARY.match(path.name)
    return int(match.group(1)) if match and path.is_file() else None


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends without an error it gets the
    umask's mode and replaces ``path``, otherwise it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        honour_umask(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_files(folder: str | Path) -> Iterator[Path]:
    """A temporary folder inside ``folder`` for a library that writes files by name (``save_pretrained``);
    when the block ends without an error each file in it gets the umask's mode and replaces its namesake
    in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".saving-") as tmp:
        yield Path(tmp)
        honour_umask(tmp)
        for file in sorted(Path(tmp).iterdir()):
            os.replace(file, folder / file.name)


def check_folder_can_be_made(folder: str | Path, flag: str) -> None:
    """Refuse, before anything loads, a folder a run will write into but could not make: a file on its path, or
    a parent that takes no new entries (read-only, ``/proc``). Leaves nothing behind: the trial folder it makes
    in the nearest existing parent is removed at once."""
    folder = Path(folder)
    if folder.is_dir():
        return
    parent = next((p for p in folder.absolute().parents if p.exists()), None)
    blocking = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"{flag} {folder}: {blocking} is a file, so the folder cannot be made there; give "
                        "another path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dreamstep-check-", dir=parent))
    except OSError as error:
        raise UserError(f"{flag} {folder}: cannot make the folder in {parent} ({error.strerror}); give a path "
                        "you can write to") from None
