"""File permissions of what dreamstep writes.

safetensors (and so diffusers' ``save_pretrained``) and ``tempfile.mkstemp`` create files with mode 0600,
whatever the umask: a LoRA written that way cannot be read by another account, such as the one a
ComfyUI server runs under. Everything dreamstep writes gets the mode a plain ``open()`` would give.
"""

from __future__ import annotations

import os
from pathlib import Path


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
