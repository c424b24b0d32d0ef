"""The JSON API of training jobs: list, create, stop, resume, sample now, cancel and reorder.

``GET /api/jobs``, ``GET /api/jobs/{id}``, ``GET /api/jobs/{id}/log``, ``GET /api/trainers``;
``POST /api/jobs`` (``{"trainer", "output_root", "name", "options"}``) and
``POST /api/jobs/{id}/{stop|resume|sample|cancel|up|down}``; before queuing, with the body of ``POST /api/jobs``:
``POST /api/jobs/check`` (the TOML and command), ``/api/jobs/dataset`` (the dataset check) and ``/api/jobs/plan``
(the memory plan), each by the trainer's own code, loading no model. A refused request is answered
``{"error": ..., "field": ...}`` with the field that is wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from dreamstep.config.sections import SECTIONS
from dreamstep.dashboard.dataset_check import check_trainer_data, summary
from dreamstep.dashboard.job_requests import (
    FieldError,
    check_job_request,
    form_fields,
    json_object,
    named_field,
    options_from_toml,
)
from dreamstep.dashboard.jobs import Job, JobError, JobQueue, JobRunner
from dreamstep.dashboard.run_plan import job_plan
from dreamstep.dashboard.runs import RunIndex
from dreamstep.engine.run_folder import read_status
from dreamstep.errors import UserError

__all__ = ["Training", "job_routes", "log_lines"]

_LOG_TAIL = 64 * 1024
PREVIEW_NAME = "preview"  # the run name a preview is checked with when the form has none yet


@dataclass
class Training:
    """What the dashboard needs to run jobs: the queue and its runner, the folders jobs may use, and the
    token every change needs."""

    output_roots: list[Path]
    data_roots: list[Path]
    state_dir: Path
    token: str
    max_running: int = 1
    queue: JobQueue = field(init=False)
    runner: JobRunner = field(init=False)

    def __post_init__(self) -> None:
        self.queue = JobQueue(self.state_dir / "jobs.sqlite")
        self.runner = JobRunner(self.queue, self.state_dir, self.max_running)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        self.runner.start()
        try:
            yield
        finally:
            self.runner.close()


def job_routes(training: Training, index: RunIndex) -> list[Route]:
    queue, runner = training.queue, training.runner

    def shown(job: Job) -> dict[str, Any]:
        data = job.shown()
        folder = Path(job.output_dir)
        data["status"] = read_status(folder)
        data["run_id"] = next((run.id for run in index.runs().values() if run.folder.resolve() == folder), None)
        return data

    def trainers(request: Request) -> Response:
        from dreamstep.cli import COMMANDS

        return JSONResponse({"trainers": [key[1] for key in COMMANDS if key[0] == "train"],
                             "output_roots": [str(r) for r in training.output_roots],
                             "data_roots": [str(r) for r in training.data_roots]})

    def list_jobs(request: Request) -> Response:
        return JSONResponse({"jobs": [shown(job) for job in queue.all()]})

    def form(request: Request) -> Response:
        try:
            return JSONResponse({"fields": form_fields(request.path_params["trainer"]),
                                 "groups": list(SECTIONS)})
        except FieldError as e:
            return JSONResponse({"error": str(e), "field": e.field}, 404)

    async def check(request: Request) -> Response:
        """What a job would run (its TOML and command), or the field that is wrong; queues nothing."""
        try:
            job_request = check_job_request(json_object(await request.body()), training.output_roots,
                                            training.data_roots)
        except ValueError as e:
            return JSONResponse({"error": str(e), "field": getattr(e, "field", None)}, 400)
        command = ["dreamstep", "train", job_request.trainer, "--config", "JOB.toml",
                   "--output_dir", str(job_request.output_dir)]
        return JSONResponse({"toml": job_request.config_toml, "command": command})

    async def preview(request: Request) -> Response:
        """The dataset check (``/api/jobs/dataset``) or the memory plan (``/api/jobs/plan``) of what a job would
        run, by its trainer's own code, without loading a model; queues nothing. The run's name may be left out."""
        body: dict[str, Any] = {}
        try:
            body = json_object(await request.body())
            if not body.get("name"):
                body = {**body, "name": PREVIEW_NAME}
            job_request = check_job_request(body, training.output_roots, training.data_roots)
            check = await run_in_threadpool(check_trainer_data, job_request.trainer, job_request.config, None,
                                            training.output_roots + training.data_roots)
            if request.url.path.endswith("/dataset"):
                return JSONResponse({"dataset": summary(check, 0)})
            plan = await run_in_threadpool(job_plan, job_request.trainer, job_request.config, check)
        except (UserError, OSError) as e:  # the trainer's own refusal; a model file or folder that cannot be read
            options = body.get("options")
            return JSONResponse({"error": str(e), "field": named_field(str(e), set(options) if isinstance(options, dict)
                                                                       else set())}, 400)
        except ValueError as e:
            return JSONResponse({"error": str(e), "field": getattr(e, "field", None)}, 400)
        return JSONResponse({"plan": plan})

    async def from_toml(request: Request) -> Response:
        try:
            body = json_object(await request.body())
            options = options_from_toml(str(body.get("trainer", "")), str(body.get("toml", "")),
                                        training.output_roots + training.data_roots)
        except ValueError as e:
            return JSONResponse({"error": str(e), "field": getattr(e, "field", None)}, 400)
        return JSONResponse({"options": options})

    async def create(request: Request) -> Response:
        try:
            body = json_object(await request.body())
            job_request = check_job_request(body, training.output_roots, training.data_roots)
            job = queue.add(job_request.trainer, job_request.config_toml, str(job_request.output_dir))
        except ValueError as e:  # bad JSON, FieldError, JobError
            return JSONResponse({"error": str(e), "field": getattr(e, "field", None)}, 400)
        runner.tick()
        return JSONResponse({"job": shown(queue.get(job.id))}, 201)

    def one(request: Request) -> Response:
        job = queue.get(_job_id(request)) if _job_id(request) is not None else None
        return JSONResponse({"job": shown(job)}) if job else _no_such_job()

    def log(request: Request) -> Response:
        job_id = _job_id(request)
        if job_id is None or queue.get(job_id) is None or not runner.log_path(job_id).is_file():
            return _no_such_job()
        path = runner.log_path(job_id)
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - _LOG_TAIL))
            return JSONResponse({"log": log_lines(f.read().decode("utf-8", errors="replace"))})

    def action(request: Request) -> Response:
        job_id, name = _job_id(request), request.path_params["action"]
        actions = {"stop": runner.stop, "sample": runner.sample_now, "resume": queue.requeue_for_resume,
                   "cancel": queue.cancel, "up": lambda i: queue.move(i, -1), "down": lambda i: queue.move(i, 1)}
        if name not in actions:
            return JSONResponse({"error": f"no action '{name}'; use one of {', '.join(actions)}", "field": "action"},
                                404)
        if job_id is None:
            return _no_such_job()
        try:
            actions[name](job_id)
        except LookupError:
            return _no_such_job()
        except JobError as e:
            return JSONResponse({"error": str(e), "field": "job_id"}, 409)
        runner.tick()
        return JSONResponse({"job": shown(queue.get(job_id))})

    return [
        Route("/api/trainers", trainers),
        Route("/api/trainers/{trainer}/form", form),
        Route("/api/jobs/check", check, methods=["POST"]),
        Route("/api/jobs/from_toml", from_toml, methods=["POST"]),
        Route("/api/jobs/dataset", preview, methods=["POST"]),
        Route("/api/jobs/plan", preview, methods=["POST"]),
        Route("/api/jobs", list_jobs, methods=["GET"]),
        Route("/api/jobs", create, methods=["POST"]),
        Route("/api/jobs/{job_id:int}", one),
        Route("/api/jobs/{job_id:int}/log", log),
        Route("/api/jobs/{job_id:int}/{action}", action, methods=["POST"]),
        Route("/new", new_run_page),
    ]


async def new_run_page(request: Request) -> Response:
    return FileResponse(Path(__file__).parent / "static" / "new.html")


def log_lines(text: str) -> list[str]:
    """A process's output as the terminal shows it: a progress bar redraws its line with carriage returns, so each
    line is its last state, not one line per redraw."""
    lines = text.split("\n")
    if lines and not lines[-1].strip("\r"):
        lines.pop()  # the end of the last line
    return [next((part for part in reversed(line.split("\r")) if part), "") for line in lines]


def _job_id(request: Request) -> int | None:
    """The job id of the path; ``None`` beyond SQLite's 64-bit integers (no job has such an id)."""
    job_id = request.path_params["job_id"]
    return job_id if job_id < 2**63 else None


def _no_such_job() -> Response:
    return JSONResponse({"error": "no such job", "field": "job_id"}, 404)
