"""The output folder of a run: one run at a time (a lock that names its holder and outlives no killed run),
which folders a fresh run or a resume may use, and saves that delete only their own leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_testkit import RegressionStep, tiny_mlp

from dreamstep.engine.checkpoint import TrainingPosition, save_checkpoint
from dreamstep.engine.run_folder import LOCK_FILE, STATUS_FILE, OutputLock, check_output_dir
from dreamstep.errors import UserError

HOLD_LOCK = """
import sys, time
from pathlib import Path
from dreamstep.engine.run_folder import OutputLock
OutputLock.acquire(Path(sys.argv[1]), "holder")
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding ``tmp_path / 'out'``'s lock; yields (folder, process)."""
    folder = tmp_path / "out"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True,
                               env=env)
    assert process.stdout.readline().strip() == "locked"
    yield folder, process
    process.kill()
    process.wait()


def _check(folder: Path, resume_request: str | None = None, overwrite: bool = False) -> Path:
    return check_output_dir(folder, overwrite=overwrite, resume=None, resume_request=resume_request,
                            resume_flag="--resume_from_checkpoint")


def test_a_second_run_is_refused_naming_the_first_ones_process(holder) -> None:
    folder, process = holder
    for attempt in (lambda: OutputLock.acquire(folder, "second"), lambda: _check(folder),
                    lambda: _check(folder, overwrite=True)):
        with pytest.raises(UserError, match=rf"in use by another run \(process {process.pid} on ") as error:
            attempt()
        assert "\n" not in str(error.value)


def test_the_lock_of_a_killed_run_is_taken_over(holder) -> None:
    folder, process = holder
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == process.pid  # the dead run's lock is left
    _check(folder)  # a lock file nobody holds is no reason to refuse
    lock, previous = OutputLock.acquire(folder, "next")
    assert previous["pid"] == process.pid
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (folder / LOCK_FILE).exists()


def _status(folder: Path, state: str) -> None:
    (folder / STATUS_FILE).write_text(json.dumps({"state": state, "pid": 1, "step": 3}))


def _leftovers_of_a_run_killed_while_loading(folder: Path) -> None:
    _status(folder, "running")
    (folder / "cache" / "latents").mkdir(parents=True)
    (folder / LOCK_FILE).write_text('{"pid": 999999999}')


def _leftovers_of_a_run_killed_in_its_first_save(folder: Path) -> None:
    _status(folder, "interrupted")
    (folder / "config.toml").write_text("rank = 4\n")
    (folder / "events.out.tfevents.1.host").write_bytes(b"\0")
    (folder / "samples").mkdir()
    (folder / ".checkpoint-3.tmp-999999999").mkdir()
    (folder / ".checkpoint-3.tmp-999999999" / "optimizer.pt").write_bytes(b"half")


ACCEPTED = {
    "missing": lambda folder: folder.rmdir(),
    "empty": lambda folder: None,
    "only a stale lock": lambda folder: (folder / LOCK_FILE).write_text("{}"),
    "killed while loading": _leftovers_of_a_run_killed_while_loading,
    "killed in its first save": _leftovers_of_a_run_killed_in_its_first_save,
}


def _user_files(folder: Path) -> None:
    (folder / "config.toml").write_text("my settings\n")
    (folder / "my_lora.safetensors").write_bytes(b"weights")
    (folder / "notes.txt").write_text("keep me\n")


def _unfinished_with_checkpoint(folder: Path) -> None:
    _leftovers_of_a_run_killed_in_its_first_save(folder)
    (folder / "checkpoint-3").mkdir()


def _unfinished_with_weights(folder: Path) -> None:
    _leftovers_of_a_run_killed_in_its_first_save(folder)
    (folder / "last-step00000002.safetensors").write_bytes(b"weights")


REFUSED = {
    "the user's files": _user_files,
    "one note": lambda folder: (folder / "notes.txt").write_text("mine"),
    "a sub-folder": lambda folder: (folder / "photos").mkdir(),
    "a finished run": lambda folder: (_status(folder, "finished"), (folder / "config.toml").write_text("")),
    "an unfinished run with a checkpoint": _unfinished_with_checkpoint,
    "an unfinished run with saved weights": _unfinished_with_weights,
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_a_fresh_run_or_a_resume_with_nothing_to_resume_may_use(case: str, tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    ACCEPTED[case](folder)
    assert _check(folder) == folder
    assert _check(folder, resume_request="latest") == folder


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("case", REFUSED)
def test_a_fresh_run_or_a_resume_with_nothing_to_resume_refuses(case: str, tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    REFUSED[case](folder)
    before = _snapshot(folder)
    with pytest.raises(UserError, match=rf"--output_dir {folder} (is not empty|holds checkpoint-3 of an unfinished)"):
        _check(folder)
    if "checkpoint" not in case:
        with pytest.raises(UserError, match=rf"--resume_from_checkpoint latest: {folder} holds no checkpoint to "
                                            r"resume, but it holds other files \("):
            _check(folder, resume_request="latest")
    assert _check(folder, overwrite=True) == folder
    assert _snapshot(folder) == before


def test_resuming_another_folders_checkpoint_into_a_folder_with_files_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    _user_files(folder)
    elsewhere = tmp_path / "old" / "checkpoint-3"
    elsewhere.mkdir(parents=True)
    with pytest.raises(UserError, match="is not empty .* and is not where .*checkpoint-3 came from"):
        check_output_dir(folder, overwrite=False, resume=elsewhere, resume_request=str(elsewhere),
                         resume_flag="--resume")
    assert check_output_dir(tmp_path / "old", overwrite=False, resume=elsewhere, resume_request="latest",
                            resume_flag="--resume") == tmp_path / "old"


def test_a_save_deletes_only_its_own_leftovers_and_those_of_dead_processes(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getppid()  # alive, and not this process
    for name in (f".checkpoint-1.tmp-{os.getpid()}", f".checkpoint-1.tmp-{dead.pid}",
                 f".checkpoint-1.old-{dead.pid}", f".checkpoint-2.tmp-{live}", ".checkpoint-notes"):
        (tmp_path / name).mkdir()
    # A run killed (kill -9) while it rewrote its status leaves the temporary file of that atomic write.
    for name in (f".run_status.json.{dead.pid}.tmp", f".config.toml.{dead.pid}.tmp", f".run_status.json.{live}.tmp",
                 ".notes.tmp"):
        (tmp_path / name).write_text("{")
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    save_checkpoint(tmp_path, step, TrainingPosition(global_step=3), model.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".checkpoint-2.tmp-{live}", ".checkpoint-notes",
                                                          ".notes.tmp", f".run_status.json.{live}.tmp",
                                                          "checkpoint-3"]
