"""A full disk as one clear error: checked before each save, and recognised when a write fails anyway.

Writers report a full disk in many ways: ``OSError`` errno 28, safetensors' ``SafetensorError ... os error
28``, torch's ``basic_ios::clear`` or ``file write failed``. :func:`is_disk_full` knows them all.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from dreamstep.errors import UserError

__all__ = ["DiskFullError", "disk_full_message", "format_bytes", "free_bytes", "headroom", "is_disk_full",
           "require_space"]

# Room left over after a save, for the logs, the status file and the loss curve: a tenth of the save, and
# this much more.
HEADROOM_BASE_BYTES = 256 * 2**10
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("no space left", "os error 28", "storagefull", "disk quota", "basic_ios::clear", "file write failed")


class DiskFullError(UserError):
    """Not enough free space for the next save."""


def free_bytes(path: str | Path) -> int:
    """Free space on the filesystem that holds ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def require_space(path: str | Path, needed: int, what: str, keeps: str) -> None:
    """Raise :class:`DiskFullError` when ``path``'s disk cannot take ``needed`` more bytes (plus headroom).
    ``what`` names the save (e.g. "checkpoint-500"); ``keeps`` says what stays good (e.g. the last checkpoint)."""
    free = free_bytes(path)
    if free < needed + headroom(needed):
        raise DiskFullError(disk_full_message(path, needed, what, keeps, free))


def headroom(needed: int) -> int:
    """What must stay free beyond a save of ``needed`` bytes."""
    return needed // 10 + HEADROOM_BASE_BYTES


def disk_full_message(path: str | Path, needed: int, what: str, keeps: str, free: int | None = None) -> str:
    free = free_bytes(path) if free is None else free
    return (f"the disk is full: {what} needs about {format_bytes(needed + headroom(needed))} in {path}, which has "
            f"{format_bytes(free)} free; {keeps}. Free some space (or move --output_dir) and run again")


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says the disk or the quota is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            return True
        if any(text in str(error).lower() for text in _FULL_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def format_bytes(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KB", "MB"):
        count /= 1024
        if count < 1024:
            return f"{count:.1f} {unit}"
    return f"{count / 1024:.1f} GB"
