"""The dashboard's web application (Starlette): a static page, a JSON API and files from run folders.

Read-only unless started with training (:class:`Training`): then POST to ``/api/jobs...`` queues, stops,
resumes and samples jobs; every other request than GET or HEAD is answered 405 before routing. Files are
served only through :func:`resolve_inside`, dataset images only by their index in the checked list.

Tokens: ``token`` (for a server bound beyond loopback) is needed on every request (header
``Authorization: Bearer``, ``?token=``, or the cookie set after a page opened with ``?token=``).
``change_token`` is needed on every POST, in the ``Authorization: Bearer`` or ``X-Dreamstep-Token`` header
only: a cross-site page can make a browser send cookies and forms, never a custom header (no CORS here), so
a forged POST fails. POSTs must also be JSON, and any ``Origin`` they carry must be this server's. With
``local_hosts``, a request whose ``Host`` is not a loopback name is refused (a DNS-rebinding page).
"""

from __future__ import annotations

import functools
import hmac
import io
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dreamstep.dashboard.caption_routes import CaptionEditing, caption_routes
from dreamstep.dashboard.dataset_check import DatasetCheck, check_dataset, summary
from dreamstep.dashboard.job_routes import Training, job_routes
from dreamstep.dashboard.paths import UnsafePath, resolve_inside
from dreamstep.dashboard.runs import RunIndex, read_section

__all__ = ["create_app"]

STATIC = Path(__file__).parent / "static"
TOKEN_COOKIE = "dreamstep_token"
_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Everything comes from this server: no CDN, no inline script, nothing framed.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "frame-ancestors 'none'; form-action 'none'",
}


class _JSON(JSONResponse):
    """JSON with NaN and infinities as ``null`` (a diverged loss is NaN; browsers reject NaN in JSON)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _Guard(BaseHTTPMiddleware):
    """The methods, hosts and tokens allowed (see the module's docstring); security headers on every answer."""

    def __init__(self, app: Any, token: str | None, change_token: str | None = None, local_hosts: bool = False,
                 change_paths: tuple[str, ...] = ("/api/jobs",)):
        super().__init__(app)
        self.token, self.change_token, self.local_hosts = token, change_token, local_hosts
        self.change_paths = change_paths

    async def dispatch(self, request: Request, call_next: Any) -> Response:
        refused = self._refusal(request)
        if refused is not None:
            return self._headers(refused)
        from_query = request.query_params.get("token")
        response = await call_next(request)
        if self.token is not None and from_query:
            response.set_cookie(TOKEN_COOKIE, self.token, httponly=True, samesite="strict")
        return self._headers(response)

    def _refusal(self, request: Request) -> Response | None:
        if self.local_hosts and request.url.hostname not in ("127.0.0.1", "localhost", "::1", "[::1]"):
            return PlainTextResponse("this dashboard answers only to a loopback address", 403)
        header = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        header = header or request.headers.get("x-dreamstep-token", "")
        if self.token is not None:
            offered = header or request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE) or ""
            if not _same(offered, self.token):
                return PlainTextResponse("a token is needed: open the address printed by "
                                         "'dreamstep dashboard', which ends in ?token=...", 401)
        if request.method in ("GET", "HEAD"):
            return None
        if self.change_token is None or request.method != "POST" or not request.url.path.startswith(self.change_paths):
            allowed = "GET, HEAD, POST" if self.change_token else "GET, HEAD"
            return PlainTextResponse("the dashboard is read-only" if not self.change_token else "method not allowed",
                                     405, headers={"Allow": allowed})
        if not _same(header, self.change_token):
            return PlainTextResponse("a change needs the token in the X-Dreamstep-Token or Authorization header",
                                     403)
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return PlainTextResponse(f"cross-site request from {origin} refused", 403)
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return PlainTextResponse("a change must be sent as application/json", 415)
        return None

    @staticmethod
    def _headers(response: Response) -> Response:
        response.headers.update(_HEADERS)
        if "cache-control" not in response.headers:
            response.headers["Cache-Control"] = "no-store"
        return response


def _same(offered: str, expected: str) -> bool:
    return hmac.compare_digest(offered.encode(), expected.encode())


class _DatasetState:
    """The dataset check, computed at start and again on ``?rescan=1`` (by ``recheck``); thumbnails cached
    (LRU)."""

    def __init__(self, source: str | None, recheck: Callable[[], DatasetCheck] | None, check: DatasetCheck | None):
        self.source, self.recheck, self.check = source, recheck, check
        self.thumbs: OrderedDict[tuple[int, int, bool], bytes] = OrderedDict()
        self.lock = threading.Lock()

    def rescan(self) -> None:
        if self.recheck is not None:
            self.check = self.recheck()
        self.thumbs.clear()


def create_app(run_dirs: list[Path], *, dataset: str | None = None, dataset_check: DatasetCheck | None = None,
               recheck: Callable[[], DatasetCheck] | None = None, token: str | None = None,
               training: Training | None = None, local_hosts: bool = False,
               captions: CaptionEditing | None = None) -> Starlette:
    """The application over ``run_dirs`` and the check of a dataset (``dataset`` names it). ``dataset_check``: the
    check made before starting (the command makes it first, so a bad TOML fails at the door); ``recheck`` makes
    it again (``?rescan=1``; default: :func:`check_dataset` of ``dataset`` as flux-lora reads it).
    ``training``: the job queue and what changing it needs (None: read-only). ``captions``: caption editing in the
    dataset check (:mod:`~dreamstep.dashboard.caption_routes`; its token is the training token when both are on)."""
    index = RunIndex([Path(d) for d in run_dirs])
    if dataset is not None and recheck is None:
        recheck = functools.partial(check_dataset, dataset)
    state = _DatasetState(dataset, recheck, dataset_check)
    if dataset is not None and dataset_check is None:
        state.rescan()

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    def info(request: Request) -> Response:
        return _JSON({"roots": [str(r) for r in index.roots], "dataset": state.source,
                      "training": training is not None, "captions": captions is not None})

    def runs(request: Request) -> Response:
        return _JSON({"runs": [read_section(run.summary) for run in index.runs().values()]})

    def run_detail(request: Request) -> Response:
        run = index.get(request.path_params["run_id"])
        if run is None:
            return _JSON({"error": "no such run"}, 404)
        return _JSON(run.detail())

    def run_samples(request: Request) -> Response:
        run = index.get(request.path_params["run_id"])
        if run is None:
            return _JSON({"error": "no such run"}, 404)
        return _JSON({"samples": read_section(run.samples)})

    def run_loras(request: Request) -> Response:
        run = index.get(request.path_params["run_id"])
        if run is None:
            return _JSON({"error": "no such run"}, 404)
        return _JSON({"loras": read_section(run.loras)})

    def run_file(request: Request) -> Response:
        run = index.get(request.path_params["run_id"])
        if run is None:
            return PlainTextResponse("no such run", 404)
        try:
            path = resolve_inside(run.folder, request.path_params["path"])
        except UnsafePath as e:
            return PlainTextResponse(f"refused: {e}", 404)
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    def dataset_summary(request: Request) -> Response:
        if state.source is None:
            return _JSON({"error": "no dataset: start with 'dreamstep dashboard --dataset TOML_OR_FOLDER'"},
                                404)
        with state.lock:
            if request.query_params.get("rescan") == "1":
                state.rescan()
            epoch = _int(request.query_params.get("epoch"), 0)
            return _JSON(summary(state.check, epoch))

    def dataset_image(request: Request) -> Response:
        check = state.check
        number = _int(request.path_params["number"], -1)
        mask = request.url.path.startswith("/api/dataset/mask/")
        if check is None or not 0 <= number < len(check.images) or (mask and check.images[number].mask is None):
            return PlainTextResponse("no such image", 404)
        size = min(1024, max(32, _int(request.query_params.get("size"), 256)))
        key = (number, size, mask)
        with state.lock:
            data = state.thumbs.get(key)
        if data is None:
            image = check.images[number]
            data = (_thumbnail(image.mask, size, check.subsets[image.subset][1].mask_source) if mask
                    else _thumbnail(image.path, size))
            if data is None:
                return PlainTextResponse("unreadable image", 404)
            with state.lock:
                state.thumbs[key] = data
                while len(state.thumbs) > 4000:
                    state.thumbs.popitem(last=False)
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "max-age=60"})

    routes = [
        Route("/", page),
        Route("/api/info", info),
        Route("/api/runs", runs),
        Route("/api/runs/{run_id}", run_detail),
        Route("/api/runs/{run_id}/loras", run_loras),
        Route("/api/runs/{run_id}/samples", run_samples),
        Route("/files/{run_id}/{path:path}", run_file),
        Route("/api/dataset", dataset_summary),
        Route("/api/dataset/image/{number}", dataset_image),
        Route("/api/dataset/mask/{number}", dataset_image),
        Mount("/static", StaticFiles(directory=STATIC)),
    ]
    if training is not None:
        routes += job_routes(training, index)
    if captions is not None:
        routes += caption_routes(captions, state)
    change_token = training.token if training else captions.token if captions else None
    change_paths = ("/api/jobs",) * (training is not None) + ("/api/dataset/captions",) * (captions is not None)
    guard = Middleware(_Guard, token=token, change_token=change_token, local_hosts=local_hosts,
                       change_paths=change_paths)
    lifespan = training.lifespan if training is not None else None
    return Starlette(routes=routes, middleware=[guard], lifespan=lifespan)


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _thumbnail(path: Path, size: int, mask_source: str | None = None) -> bytes | None:
    """A JPEG of the image as the trainer decodes it (EXIF orientation, any mode to RGB), or of its
    ``--masked_loss`` mask (``mask_source``: alpha or conditioning), at most ``size``."""
    from dreamstep.data.images import load_rgb
    from dreamstep.data.masks import read_mask
    from dreamstep.errors import UserError

    try:
        image = read_mask(path, mask_source) if mask_source is not None else load_rgb(path)
    except (UserError, OSError):
        return None
    image.thumbnail((size, size))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=85)
    return buffer.getvalue()
