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
