"""The one gate between a URL and a file: a relative path is served only when it names a regular file
that really lies inside one of the folders the user gave, after every symlink is followed.

Refused, each for its own reason: empty paths, absolute paths (``/etc/passwd``, ``C:\\x``), ``..`` and
``.`` segments, backslashes, NUL and other control characters, a leftover ``%`` (a second round of
percent-encoding such as ``%252e%252e``), hidden files (``.git``), and anything whose real path leaves the
folder (a symlink to ``/etc`` or to a sibling folder).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["UnsafePath", "resolve_inside"]


class UnsafePath(ValueError):
    """A requested path that must not be served; the message says why (it is shown to the client)."""


def _check_text(relative: str) -> list[str]:
    if not relative:
        raise UnsafePath("empty path")
    if "\\" in relative:
        raise UnsafePath("backslashes are not allowed")
    if "%" in relative:
        raise UnsafePath("percent-encoded characters are not allowed")
    if any(ord(c) < 32 or ord(c) == 127 for c in relative):
        raise UnsafePath("control characters are not allowed")
    if relative.startswith("/") or (len(relative) > 1 and relative[1] == ":"):
        raise UnsafePath("absolute paths are not allowed")
    parts = relative.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafePath("empty, '.' and '..' path segments are not allowed")
        if part.startswith("."):
            raise UnsafePath("hidden files are not served")
    return parts


def resolve_inside(root: Path, relative: str) -> Path:
    """The real path of ``root/relative`` if it is a regular file inside ``root``'s real path; otherwise
    :class:`UnsafePath` (also for a missing file, so a probe learns nothing about what lies outside)."""
    parts = _check_text(relative)
    real_root = Path(os.path.realpath(root))
    candidate = Path(os.path.realpath(real_root.joinpath(*parts)))
    if candidate != real_root and real_root not in candidate.parents:
        raise UnsafePath("the path leads outside the served folder")
    if not candidate.is_file():
        raise UnsafePath("no such file")
    return candidate
