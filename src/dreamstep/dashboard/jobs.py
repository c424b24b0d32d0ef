"""Training jobs started from the dashboard: a queue in SQLite and one ``dreamstep train`` process per job.

Each job is its own process (``python -m dreamstep train TRAINER --config JOB.toml --output_dir RUN``, an
argument list, never a shell) in a new session, so stopping or restarting the dashboard leaves it running;
a restarted dashboard finds it again by its process id and command line. A job's state is one of
``queued``, ``running``, ``finished``, ``failed``, ``stopped`` (its run was interrupted: Stop sends SIGINT,
as Ctrl-C does, so the run finishes its step and writes a checkpoint) and ``cancelled`` (left the queue
before it ran). At most ``max_running`` jobs run at once (one per device by default).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dreamstep.engine.run_folder import SAMPLE_REQUEST, read_status

__all__ = ["Job", "JobQueue", "JobRunner", "JobError"]

ENDED = ("finished", "failed", "stopped", "cancelled")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    trainer TEXT NOT NULL,
    config_toml TEXT NOT NULL,
    output_dir TEXT NOT NULL,
    state TEXT NOT NULL,
    queue_position REAL NOT NULL,
    resume INTEGER NOT NULL DEFAULT 0,
    pid INTEGER,
    exit_code INTEGER,
    message TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL
)
"""


class JobError(ValueError):
    """A request the queue refuses (a job in the wrong state for it); the message says why."""


@dataclass
class Job:
    id: int
    trainer: str
    config_toml: str
    output_dir: str
    state: str
    queue_position: float
    resume: int
    pid: int | None
    exit_code: int | None
    message: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None

    def command(self, toml_path: Path) -> list[str]:
        """The argument list of this job's process (``toml_path``: where its TOML is written)."""
        argv = [sys.executable, "-m", "dreamstep", "train", self.trainer, "--config", str(toml_path),
                "--output_dir", self.output_dir]
        return argv + (["--resume_from_checkpoint", "latest"] if self.resume else [])

    def shown(self) -> dict[str, Any]:
        """The job as the API shows it, with the command a user can copy."""
        data = asdict(self)
        data["command"] = ["dreamstep", "train", self.trainer, "--config", "JOB.toml", "--output_dir",
                           self.output_dir] + (["--resume_from_checkpoint", "latest"] if self.resume else [])
        return data


class JobQueue:
    """The jobs table. Every method opens its own connection, so threads can share one queue."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute(_SCHEMA)

    @contextlib.contextmanager
    def _connect(self) -> Any:
        db = sqlite3.connect(self.path, timeout=30, isolation_level="IMMEDIATE")
        db.row_factory = sqlite3.Row
        try:
            with db:
                yield db
        finally:
            db.close()

    def add(self, trainer: str, config_toml: str, output_dir: str) -> Job:
        with self._connect() as db:
            if db.execute("SELECT 1 FROM jobs WHERE output_dir = ? AND state IN ('queued', 'running')",
                          (output_dir,)).fetchone():
                raise JobError(f"{output_dir}: a queued or running job already uses this output folder")
            cursor = db.execute(
                "INSERT INTO jobs (trainer, config_toml, output_dir, state, queue_position, created_at) "
                "VALUES (?, ?, ?, 'queued', (SELECT COALESCE(MAX(queue_position), 0) + 1 FROM jobs), ?)",
                (trainer, config_toml, output_dir, time.time()))
            job_id = cursor.lastrowid
        return self.get(job_id)

    def get(self, job_id: int) -> Job | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return Job(**dict(row)) if row else None

    def all(self) -> list[Job]:
        """Running jobs, then the queue in order, then ended jobs (newest first)."""
        with self._connect() as db:
            rows = db.execute("SELECT * FROM jobs ORDER BY CASE state WHEN 'running' THEN 0 WHEN 'queued' THEN 1 "
                              "ELSE 2 END, CASE WHEN state = 'queued' THEN queue_position ELSE -id END").fetchall()
        return [Job(**dict(row)) for row in rows]

    def in_state(self, state: str) -> list[Job]:
        return [job for job in self.all() if job.state == state]

    def update(self, job_id: int, **values: Any) -> None:
        columns = ", ".join(f"{name} = ?" for name in values)
        with self._connect() as db:
            db.execute(f"UPDATE jobs SET {columns} WHERE id = ?", (*values.values(), job_id))

    def requeue_for_resume(self, job_id: int) -> Job:
        job = self.require(job_id, ("stopped", "failed"), "resume")
        with self._connect() as db:
            db.execute("UPDATE jobs SET state = 'queued', resume = 1, pid = NULL, exit_code = NULL, message = NULL, "
                       "ended_at = NULL, queue_position = (SELECT COALESCE(MAX(queue_position), 0) + 1 FROM jobs) "
                       "WHERE id = ?", (job.id,))
        return self.get(job_id)

    def cancel(self, job_id: int) -> Job:
        self.require(job_id, ("queued",), "cancel")
        self.update(job_id, state="cancelled", ended_at=time.time())
        return self.get(job_id)

    def move(self, job_id: int, offset: int) -> Job:
        """Move a queued job ``offset`` places (negative: towards the front)."""
        self.require(job_id, ("queued",), "move")
        queued = [job.id for job in self.in_state("queued")]
        where = queued.index(job_id)
        queued.insert(max(0, min(len(queued) - 1, where + offset)), queued.pop(where))
        with self._connect() as db:
            db.executemany("UPDATE jobs SET queue_position = ? WHERE id = ?",
                           [(place + 1, job) for place, job in enumerate(queued)])
        return self.get(job_id)

    def require(self, job_id: int, states: tuple[str, ...], action: str) -> Job:
        job = self.get(job_id)
        if job is None:
            raise LookupError(f"no job {job_id}")
        if job.state not in states:
            raise JobError(f"job {job_id} is {job.state}; only a {' or '.join(states)} job can {action}")
        return job


class JobRunner:
    """Starts queued jobs when a slot is free and follows running ones to their end, in a thread.

    ``state_dir`` holds each job's TOML and its console output (``job-N.toml``, ``job-N.log``)."""

    def __init__(self, queue: JobQueue, state_dir: Path, max_running: int = 1, interval: float = 0.5):
        self.queue, self.state_dir, self.max_running, self.interval = queue, state_dir, max_running, interval
        self._processes: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dreamstep-jobs", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop following jobs (the jobs themselves go on running)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.interval)

    def tick(self) -> None:
        with self._lock:
            running = [job for job in self.queue.in_state("running") if not self._ended(job)]
            for job in self.queue.in_state("queued")[:max(0, self.max_running - len(running))]:
                self._launch(job)

    def log_path(self, job_id: int) -> Path:
        return self.state_dir / f"job-{job_id}.log"

    def stop(self, job_id: int) -> Job:
        """SIGINT, as Ctrl-C: the run finishes its step, writes a checkpoint and ends as interrupted."""
        job = self.queue.require(job_id, ("running",), "stop")
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGINT)
        return job

    def sample_now(self, job_id: int) -> Job:
        job = self.queue.require(job_id, ("running",), "sample")
        (Path(job.output_dir) / SAMPLE_REQUEST).touch()
        return job

    def _launch(self, job: Job) -> None:
        toml_path = self.state_dir / f"job-{job.id}.toml"
        toml_path.write_text(job.config_toml, encoding="utf-8")
        Path(job.output_dir).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path(job.id), "ab") as log:
            process = subprocess.Popen(job.command(toml_path), stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=Path(job.output_dir).parent,
                                       start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._processes[job.id] = process
        self.queue.update(job.id, state="running", pid=process.pid, started_at=time.time(), exit_code=None)

    def _ended(self, job: Job) -> bool:
        """Whether a running job's process has ended; if so its final state is recorded."""
        process = self._processes.get(job.id)
        if process is not None:
            code = process.poll()
            if code is None:
                return False
            del self._processes[job.id]
        elif _is_job_process(job):
            return False  # started by an earlier dashboard and still running
        else:
            code = None
        (Path(job.output_dir) / SAMPLE_REQUEST).unlink(missing_ok=True)
        state, message = self._outcome(job, code)
        self.queue.update(job.id, state=state, exit_code=code, message=message, ended_at=time.time())
        return True

    def _outcome(self, job: Job, code: int | None) -> tuple[str, str | None]:
        """The job's end from its exit code (its run's status file where the code is unknown)."""
        status = read_status(Path(job.output_dir)) or {}
        if code is None:
            state = {"finished": "finished", "interrupted": "stopped"}.get(status.get("state"), "failed")
        else:
            state = "finished" if code == 0 else "stopped" if code in (130, 143) else "failed"
        if state == "finished":
            return state, None
        return state, status.get("message") or _killed(code, status) or _last_error(self.log_path(job.id))


def _is_job_process(job: Job) -> bool:
    """Whether ``job.pid`` is still this job's process (not a reused process id)."""
    if job.pid is None:
        return False
    try:
        arguments = Path(f"/proc/{job.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"dreamstep" in arguments and job.output_dir.encode() in arguments


def _killed(code: int | None, status: dict[str, Any]) -> str | None:
    """What ended a trainer that a signal killed (its run had no time to say why): from its exit code, or when the
    code is unknown (the dashboard restarted since) from its run status, which still says running."""
    if code is None:
        return _GONE if status.get("state") == "running" else None
    if code >= 0:
        return None
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"the trainer was killed by {name}" + (_BY_KILL if -code == signal.SIGKILL else "")


_BY_KILL = " (kill -9, or the system when it runs out of memory)"
_GONE = "the trainer's process ended without its run recording how: most likely it was killed" + _BY_KILL


# A progress bar's line ("train:  33%|###   | 1/3 [00:01<00:02, ...]"): what it says is not why a job ended.
_PROGRESS_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\S+\s*\[")


def _last_error(log: Path) -> str | None:
    with contextlib.suppress(OSError):
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if line.strip() and not _PROGRESS_BAR.search(line)]
        errors = [line for line in lines if line.startswith("error:")]
        return (errors or lines or ["the trainer ended without a message"])[-1]
    return None
