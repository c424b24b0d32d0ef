"""Captions in the dashboard (``dreamstep dashboard --dataset D --edit_captions``): every image of the dataset
check with its caption file, editable, and a button that captions the images without one.

``GET /api/dataset/captions``: each image's path, caption, the file it is read from (or why it cannot be
edited here) and the captioning job. ``POST /api/dataset/captions`` (``{"path", "caption"}``) writes one caption
file; ``POST /api/dataset/captions/missing`` (``{"captioner", "model", "prefix"}``) starts ``dreamstep caption``
over the dataset as its own process (never in the server), which skips every image that has a caption;
``GET /api/dataset/captions/job`` follows it.

The rules of every other change apply (the app's guard: the change token in a header, JSON, same origin,
loopback host names). A caption is written only for an image the check lists, only as the file the trainer
reads (beside the image, with its subset's caption extension), only when that file's real folder is the
subset's real image folder and it is not a link, and atomically. A captioner model named by the page must be a
hub id or a folder inside the dashboard's RUN_DIRs or --data_roots.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from dreamstep.captioning.targets import one_line
from dreamstep.config.caption import CAPTIONERS
from dreamstep.dashboard.job_requests import FieldError, json_object
from dreamstep.dashboard.job_routes import log_lines
from dreamstep.files import write_text_atomic

__all__ = ["CaptionEditing", "caption_routes"]

MAX_CAPTION = 10_000
MAX_PREFIX = 200
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_LOG_TAIL = 32 * 1024


class Refused(ValueError):
    """A request that changes nothing; ``status`` is the HTTP answer, ``field`` the key of the body that is wrong."""

    def __init__(self, message: str, status: int = 400, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field


@dataclass
class CaptionEditing:
    """What caption editing needs: the change token, the folders a captioner model may come from, and the one
    captioning process that may run at a time."""

    token: str
    model_roots: list[Path]
    log_dir: Path | None = None  # made when the first captioning job starts; removed with this object
    process: subprocess.Popen | None = None
    command: list[str] = field(default_factory=list)
    rescanned: bool = True  # whether the check was made again after the last job ended
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def log_path(self) -> Path:
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="dreamstep-captions-"))
            weakref.finalize(self, shutil.rmtree, self.log_dir, ignore_errors=True)
        return self.log_dir / "caption.log"


def caption_file(check: Any, number: int) -> Path | str:
    """Where image ``number`` of the check has its caption (the trainer's rule), or why it is not editable."""
    image = check.images[number]
    subset = check.subsets[image.subset][1]
    if subset.metadata_file is not None:
        return f"its captions are in {subset.metadata_file}; edit that file"
    if not subset.caption_extension or subset.image_dir is None:
        return "this subset reads no caption files (its class_tokens is every image's caption)"
    return image.path.with_suffix(subset.caption_extension)


def _checked_target(check: Any, number: int) -> Path:
    target = caption_file(check, number)
    if isinstance(target, str):
        raise Refused(target, 409, "path")
    folder = check.subsets[check.images[number].subset][1].image_dir
    if Path(os.path.realpath(target.parent)) != Path(os.path.realpath(folder)) or target.name.startswith("."):
        raise Refused("the caption file would lie outside the dataset's folders", 403, "path")
    if target.is_symlink():
        raise Refused(f"{target.name} is a link; the dashboard writes only plain files in the dataset", 403, "path")
    return target


def _model(value: Any, roots: list[Path]) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise Refused("model must be a hub id or a folder", field="model")
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists():
        real = Path(os.path.realpath(path))
        if not any(real == r or r in real.parents for r in (Path(os.path.realpath(root)) for root in roots)):
            raise Refused("a model folder must lie inside a RUN_DIR or a --data_root of this dashboard", 403, "model")
        return str(real)
    if not _HUB_ID.fullmatch(value):
        raise Refused(f"model '{value}' is neither a folder nor a hub id such as owner/name", field="model")
    return value


async def _body(request: Request) -> dict[str, Any]:
    try:
        return json_object(await request.body())
    except FieldError as e:
        raise Refused(str(e), field=e.field) from None


def caption_routes(editing: CaptionEditing, state: Any) -> list[Route]:
    """The routes over the dashboard's dataset state (``check``, ``source``, ``lock``, ``rescan()``)."""

    def job_state() -> dict[str, Any]:
        process = editing.process
        if process is None:
            return {"running": False, "returncode": None, "command": [], "log": []}
        code = process.poll()
        if code is not None and not editing.rescanned:
            with state.lock:
                state.rescan()  # the new caption files change what the trainer will read
            editing.rescanned = True
        log = log_lines(editing.log_path.read_bytes()[-_LOG_TAIL:].decode("utf-8", errors="replace")) \
            if editing.log_dir is not None and editing.log_path.is_file() else []
        return {"running": code is None, "returncode": code, "command": editing.command, "log": log}

    def listing(request: Request) -> Response:
        check = state.check
        images = []
        for number, image in enumerate(check.images if check is not None else []):
            target = caption_file(check, number)
            # "caption" is what the trainer reads, which for an image without its own file is e.g. the instance
            # prompt: "has_file" tells the two apart.
            images.append({"number": number, "path": str(image.path), "name": image.path.name,
                           "caption": image.caption, "file": str(target) if isinstance(target, Path) else None,
                           "has_file": isinstance(target, Path) and target.is_file(),
                           "not_editable": target if isinstance(target, str) else None})
        return JSONResponse({"images": images, "captioners": list(CAPTIONERS), "job": job_state()})

    def write(body: dict[str, Any]) -> Response:
        caption = body.get("caption")
        if not isinstance(caption, str) or not one_line(caption):
            raise Refused("caption must be a non-empty text", field="caption")
        if len(caption) > MAX_CAPTION:
            raise Refused(f"caption is longer than {MAX_CAPTION} characters", field="caption")
        with state.lock:
            check = state.check
            paths = {str(image.path): n for n, image in enumerate(check.images)} if check is not None else {}
            number = paths.get(body.get("path")) if isinstance(body.get("path"), str) else None
            if number is None:
                raise Refused("not an image of this dataset", 404, "path")
            target = _checked_target(check, number)
            write_text_atomic(target, one_line(caption) + "\n")
            state.rescan()  # a new caption can bring an image into training
        return JSONResponse({"path": body["path"], "file": str(target), "caption": one_line(caption)})

    async def edit(request: Request) -> Response:
        try:
            return await run_in_threadpool(write, await _body(request))
        except Refused as e:
            return JSONResponse({"error": str(e), "field": e.field}, e.status)

    async def caption_missing(request: Request) -> Response:
        try:
            body = await _body(request)
            captioner = body.get("captioner", "florence2")
            if not isinstance(captioner, str) or captioner not in CAPTIONERS:
                raise Refused(f"captioner must be one of {', '.join(CAPTIONERS)}", field="captioner")
            model = _model(body.get("model"), editing.model_roots)
            prefix = body.get("prefix") or ""
            if not isinstance(prefix, str) or len(prefix) > MAX_PREFIX or any(ord(c) < 32 for c in prefix):
                raise Refused(f"prefix must be one line of at most {MAX_PREFIX} characters", field="prefix")
            with editing.lock:
                if editing.process is not None and editing.process.poll() is None:
                    raise Refused("a captioning job is running; wait for it to finish", 409, "captioner")
                # Values as --flag=value, so none can be read as another flag.
                command = [sys.executable, "-m", "dreamstep", "caption", str(state.source), f"--captioner={captioner}"]
                command += [f"--model={model}"] if model else []
                command += [f"--prefix={prefix}"] if prefix.strip() else []
                with open(editing.log_path, "wb") as log:
                    editing.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, start_new_session=True)
                editing.command, editing.rescanned = command, False
        except Refused as e:
            return JSONResponse({"error": str(e), "field": e.field}, e.status)
        return JSONResponse({"job": job_state()}, 202)

    def job(request: Request) -> Response:
        return JSONResponse({"job": job_state()})

    return [
        Route("/api/dataset/captions", listing, methods=["GET"]),
        Route("/api/dataset/captions", edit, methods=["POST"]),
        Route("/api/dataset/captions/missing", caption_missing, methods=["POST"]),
        Route("/api/dataset/captions/job", job, methods=["GET"]),
        Route("/captions", captions_page),
    ]


async def captions_page(request: Request) -> Response:
    return FileResponse(Path(__file__).parent / "static" / "captions.html")
