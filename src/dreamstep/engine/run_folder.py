"""What a run owns in its output folder, and when a folder may be used.

- ``.dreamstep.lock``: locked with ``flock`` by the run's main process while it runs. A second run in the
  same folder is refused with the first one's process id. The kernel releases the lock of a killed run, so
  the next run takes it over and says whose it was.
- ``run_status.json``: ``state`` (``running``, ``finished``, ``failed``, ``interrupted``), ``pid``, ``host``,
  ``step``, ``total_steps``, ``loss``, ``checkpoint`` (the newest one written), ``message`` (why it failed
  or stopped), ``started_at`` and ``updated_at`` (Unix seconds). Replaced atomically, so a reader (the
  dashboard, a script) never sees half a file.

A fresh run may use a folder that is missing or empty, any folder with --overwrite_output_dir, and a folder
that holds only what an unfinished run wrote before its first checkpoint (it was interrupted while loading
or during its first save): rerunning the same command then works. A resume continues the checkpoints in its
own folder; with nothing to resume it is a fresh run, under the same rules, so it never writes over files
it did not make.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from dreamstep.errors import UserError
from dreamstep.files import check_folder_can_be_made, write_text_atomic

try:
    import fcntl
except ImportError:  # Windows: folders are not locked there
    fcntl = None

__all__ = ["LOCK_FILE", "SAMPLE_REQUEST", "STATUS_FILE", "OutputLock", "RunStatus", "check_output_dir", "lock_holder",
           "read_status"]

LOCK_FILE = ".dreamstep.lock"
STATUS_FILE = "run_status.json"
# Written by the dashboard's "sample now" into a running run's folder: the run samples at its next step.
SAMPLE_REQUEST = "sample_now.request"
_CHECKPOINT_PREFIX = "checkpoint-"
_WEIGHT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")


class OutputLock:
    """An exclusive lock on an output folder, held until :meth:`release` or the process ends."""

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, folder: Path, command: str) -> tuple[OutputLock, dict[str, Any] | None]:
        """Lock ``folder`` (which must exist); return the lock and the info of a killed run whose lock
        was taken over (``None`` when the lock was free). Raises :class:`UserError` naming the holder."""
        path = folder / LOCK_FILE
        if fcntl is None:
            return cls(path, None), None
        for attempt in range(20):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if attempt < 19:  # a short peek by check_output_dir, or a holder about to leave
                    time.sleep(0.05)
                    continue
                raise UserError(_in_use(folder, _read_json(path))) from None
            except OSError as e:  # a filesystem without locks: run unlocked rather than not at all
                os.close(fd)
                print(f"note: cannot lock {path} ({e.strerror}); make sure no other run uses this folder")
                return cls(path, None), None
            if _same_file(fd, path):
                break
            os.close(fd)  # the previous holder deleted the file between our open and flock: lock the new one
        previous = _read_json(path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                                  "command": command}).encode(), 0)
        return cls(path, fd), previous if previous and previous.get("pid") != os.getpid() else None

    def release(self) -> None:
        """Delete the lock file and unlock (in that order, so a waiting run never locks a deleted file)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def lock_holder(folder: Path) -> dict[str, Any] | None:
    """The lock info of another live run holding ``folder``, else ``None``. Creates no file."""
    path = folder / LOCK_FILE
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _read_json(path) or {}
    except OSError:
        return None
    finally:
        os.close(fd)


def _in_use(folder: Path, holder: dict[str, Any] | None) -> str:
    holder = holder or {}
    since = time.strftime("%H:%M:%S", time.localtime(holder["started_at"])) if "started_at" in holder else "?"
    return (f"--output_dir {folder} is in use by another run (process {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}, started {since}); wait for it to end, or pick another folder")


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class RunStatus:
    """``run_status.json`` of a run: written by the main process only (``folder=None`` on the others)."""

    def __init__(self, folder: Path | None, resumed_step: int = 0):
        self.path = folder / STATUS_FILE if folder is not None else None
        self.fields: dict[str, Any] = {"state": "running", "pid": os.getpid(), "host": socket.gethostname(),
                                       "step": resumed_step, "total_steps": None, "loss": None,
                                       "checkpoint": None, "message": None, "started_at": time.time()}

    def update(self, **fields: Any) -> None:
        """Change ``fields`` and rewrite the file atomically."""
        self.fields.update(fields, updated_at=time.time())
        if self.path is None:
            return
        try:
            write_text_atomic(self.path, json.dumps(self.fields, indent=1))
        except OSError as e:
            if e.errno != errno.ENOSPC:  # a full disk is reported by the save that needs the space
                raise


def read_status(folder: Path) -> dict[str, Any] | None:
    """The folder's ``run_status.json``, or ``None`` when there is none (or it is unreadable)."""
    return _read_json(folder / STATUS_FILE)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def check_output_dir(output_dir: str | Path, *, overwrite: bool, resume: Path | None,
                     resume_request: str | None, resume_flag: str, check_lock: bool = True) -> Path:
    """Refuse a folder this run must not write into; see the module docstring for the rules.

    ``resume`` is the checkpoint the run would continue (``None``: none), ``resume_request`` what the user
    asked for (e.g. ``latest``) and ``resume_flag`` the flag's name, for the messages; ``check_lock=False``
    when this process holds the folder's lock. Writes nothing.
    """
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output_dir {folder} is a file; give a folder")
    check_folder_can_be_made(folder, "--output_dir")
    holder = lock_holder(folder) if check_lock else None
    if holder is not None:
        raise UserError(_in_use(folder, holder))
    if resume is not None and resume.resolve().parent == folder.resolve():
        return folder  # continuing this folder's own run
    if overwrite or _fresh_run_allowed(folder):
        return folder
    entries = _visible_entries(folder)
    checkpoints = [name for name in entries if name.startswith(_CHECKPOINT_PREFIX)]
    if resume_request == "latest":
        raise UserError(f"{resume_flag} latest: {folder} holds no checkpoint to resume, but it holds other files "
                        f"({_listing(entries)}); give the --output_dir of the run to continue, or a new folder "
                        "to start fresh")
    if resume_request:
        raise UserError(f"--output_dir {folder} is not empty ({_listing(entries)}) and is not where {resume} "
                        f"came from; give an empty or new --output_dir to continue that run in")
    if checkpoints and (read_status(folder) or {}).get("state") != "finished":
        raise UserError(f"--output_dir {folder} holds {checkpoints[-1]} of an unfinished run; continue it with "
                        f"{resume_flag} latest, pick a new folder, or pass --overwrite_output_dir")
    raise UserError(f"--output_dir {folder} is not empty ({_listing(entries)}); pick a new folder, continue it "
                    f"with {resume_flag} latest, or pass --overwrite_output_dir")


def _fresh_run_allowed(folder: Path) -> bool:
    """Missing, empty, or the leftovers of an unfinished run that saved nothing worth keeping."""
    if not folder.is_dir():
        return True
    entries = [p for p in folder.iterdir() if p.name != LOCK_FILE]
    if not entries:
        return True
    status = read_status(folder)
    if status is None or status.get("state") == "finished":
        return False
    return not any(p.name.startswith(_CHECKPOINT_PREFIX) or p.suffix in _WEIGHT_SUFFIXES for p in entries)


def _visible_entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "") if names else "hidden files"
