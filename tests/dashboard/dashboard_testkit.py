"""Run folders for the dashboard tests: runs in progress written step by step with the trainer's own
logger, and copies of finished runs."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from dreamstep.engine.logging import TrainingLogger

ROBOT_DIR = Path(__file__).resolve().parents[2] / "examples" / "robot"
FINISHED_STEPS = 4

def copy_run(run: Path, into: Path) -> Path:
    """A writable copy of a run folder (without its caches)."""
    target = into / run.name
    shutil.copytree(run, target, ignore=shutil.ignore_patterns("cache", "checkpoint-*"))
    return target


class GrowingRun:
    """A run in progress: config.toml, then steps and sample grids appended by the trainer's logger."""

    def __init__(self, folder: Path, total: int = 100):
        self.folder = folder
        folder.mkdir(parents=True)
        (folder / "config.toml").write_text(f'max_train_steps = {total}\nseed = 7\n'
                                            'validation_prompt = "a growing robot"\n')
        self.logger = TrainingLogger(folder, report_to="none")
        self.step = 0

    def add_steps(self, count: int) -> None:
        for _ in range(count):
            self.step += 1
            self.logger.log(self.step, {"loss": 1.0 / self.step, "lr": 1e-4 * min(1.0, self.step / 10)})

    def add_sample(self) -> None:
        colors = [(200, 40, 40), (40, 160, 60)]
        self.logger.log_images(self.step, [Image.new("RGB", (32, 32), c) for c in colors])


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free loopback port in a thread; yield its base URL."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the dashboard server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def raw_get(base_url: str, target: str) -> tuple[int, bytes]:
    """Send ``GET target`` exactly as written (no client-side normalisation of ``..`` or ``%2f``)."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode("latin-1"))
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data.partition(b"\r\n\r\n")[2]


class DashboardProcess:
    """``dreamstep dashboard RUNS --allow_training --data_root ...`` as its own process, as a user starts it;
    ``api`` and ``post`` talk to it with the token it printed."""

    def __init__(self, runs: Path, data_roots: list[Path], port: int | None = None):
        import os
        import subprocess
        import sys

        self.port = port or free_port()
        src = Path(__file__).resolve().parents[2] / "src"
        env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        roots = [arg for root in data_roots for arg in ("--data_root", str(root))]
        self.process = subprocess.Popen([sys.executable, "-m", "dreamstep", "dashboard", str(runs), "--allow_training",
                                         *roots, "--port", str(self.port)], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        line = self.process.stdout.readline()
        self.url = line.split()[1].partition("?")[0].rstrip("/")
        self.token = line.split("?token=")[1].split()[0]
        deadline = time.monotonic() + 60
        while True:
            try:
                self.api("/api/jobs")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def api(self, route: str) -> Any:
        import json
        import urllib.request

        with urllib.request.urlopen(f"{self.url}{route}", timeout=30) as response:
            return json.loads(response.read())

    def post(self, route: str, body: object = None) -> Any:
        import json
        import urllib.request

        request = urllib.request.Request(f"{self.url}{route}", data=json.dumps(body or {}).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "X-Dreamstep-Token": self.token})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def job(self, job_id: int) -> dict:
        return self.api(f"/api/jobs/{job_id}")["job"]

    def wait_job(self, job_id: int, condition: Any, what: str, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while not condition(job := self.job(job_id)):
            if time.monotonic() > deadline or job["state"] in ("finished", "failed", "stopped", "cancelled"):
                raise AssertionError(f"job {job_id} is {job['state']} ({job['message']}), waiting {what}")
            time.sleep(0.1)
        return job

    def close(self) -> None:
        """Ctrl-C, as a user stops it (its jobs go on)."""
        import signal

        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
