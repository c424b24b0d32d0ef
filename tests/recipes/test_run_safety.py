"""A trainer never loses work and never writes over the user's files: real signals sent to a real training
process, a full disk met on the real save path, a folder in use, and resumes with nothing to resume."""

from __future__ import annotations

import errno
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli
from safetensors import SafetensorError
from safetensors.torch import load_file

import dreamstep.engine.checkpoint as checkpoint_module
import dreamstep.engine.disk as disk
from dreamstep.engine.run_folder import LOCK_FILE, check_output_dir, read_status

TRAIN = ("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--center_crop",
         "--report_to", "none", "--learning_rate", "1e-3")


def _flux(model: Path, out: Path, *extra: object) -> list[str]:
    return [str(a) for a in ("train", "flux-lora", "--pretrained_model_name_or_path", model, "--output_dir", out,
                             *TRAIN, *extra)]


class Trainer:
    """``python -m dreamstep ARGS`` in a subprocess of its own process group, its stderr collected as it
    comes. Signals go to the whole group, as Ctrl-C in a terminal and a scheduler's SIGTERM do."""

    def __init__(self, args: list[str], stdout: int = subprocess.DEVNULL, stderr: int = subprocess.PIPE,
                 sigint_ignored: bool = False):
        """``sigint_ignored``: started as background jobs and some launchers start it, with SIGINT ignored."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        self.process = subprocess.Popen([sys.executable, "-m", "dreamstep", *args], stdout=stdout,
                                        stderr=stderr, text=True, env=env, start_new_session=True,
                                        preexec_fn=ignore)
        self.stderr = ""
        if self.process.stderr is not None:
            threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for chunk in iter(lambda: self.process.stderr.read(1), ""):
            self.stderr += chunk

    def wait_for(self, ready, what: str, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while not ready():
            assert self.process.poll() is None, f"exited {self.process.returncode} before {what}: {self.stderr[-2000:]}"
            assert time.monotonic() < end, f"no {what} after {timeout} s: {self.stderr[-2000:]}"
            time.sleep(0.02)

    def send(self, sig: signal.Signals) -> None:
        os.killpg(self.process.pid, sig)

    def finish(self, timeout: float = 120) -> int:
        code = self.process.wait(timeout)
        time.sleep(0.2)  # the reader thread drains the pipe
        return code


def _step(out: Path) -> int:
    return (read_status(out) or {}).get("step", 0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_the_step_and_the_printed_command_continues_exactly(sig: signal.Signals,
                                                                           tiny_flux_dev_dir: Path,
                                                                           tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Data-loading workers get the signal too, and must leave the stopping to the trainer. The prompt's newline,
    # quotes and backslash must reach config.toml so that the printed command reads it back.
    prompt = ("--instance_prompt", 'a photo of "sks" robot\non the moon \\ C:\\new')
    trainer = Trainer(_flux(tiny_flux_dev_dir, out, "--max_train_steps", "1000", "--checkpointing_steps", "0",
                            "--dataloader_num_workers", "1", *prompt))
    trainer.wait_for(lambda: _step(out) >= 2, "step 2")
    trainer.send(sig)
    assert trainer.finish() == 128 + sig
    step = read_status(out)["step"]
    last = out / f"checkpoint-{step}"
    assert f"stopped by {sig.name} at step {step}; the last checkpoint is {last}" in trainer.stderr
    command = shlex.split(trainer.stderr.split("continue with:\n")[1].splitlines()[0])
    assert command[:3] == ["dreamstep", "train", "flux-lora"]
    status = read_status(out)
    assert status["state"] == "interrupted" and status["checkpoint"] == f"checkpoint-{step}"
    assert not (out / LOCK_FILE).exists()

    assert run_cli(*command[1:], "--max_train_steps", step + 1) == 0
    assert read_status(out)["state"] == "finished"
    if sig == signal.SIGINT:  # the step the signal cut short ends as it would have in an uninterrupted run
        assert run_cli(*_flux(tiny_flux_dev_dir, tmp_path / "straight", "--max_train_steps", step + 1, *prompt)) == 0
        resumed = load_file(out / "pytorch_lora_weights.safetensors")
        straight = load_file(tmp_path / "straight" / "pytorch_lora_weights.safetensors")
        for key in straight:
            torch.testing.assert_close(resumed[key], straight[key], atol=1e-6, rtol=0)


def test_a_second_ctrl_c_stops_at_once(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Slow validation after every step: the second Ctrl-C comes while the step is still running.
    trainer = Trainer(_flux(tiny_flux_dev_dir, out, "--max_train_steps", "1000", "--checkpointing_steps", "0",
                            "--validation_prompt", ROBOT_PROMPT, "--validation_steps", "1",
                            "--validation_inference_steps", "300", "--num_validation_images", "1"))
    trainer.wait_for(lambda: _step(out) >= 1, "step 1")
    trainer.send(signal.SIGINT)
    trainer.wait_for(lambda: "finishing this step and saving a checkpoint" in trainer.stderr, "the first notice")
    trainer.send(signal.SIGINT)
    assert trainer.finish() == 130
    assert "stopped by SIGINT at once; no checkpoint was written; run the same command again" in trainer.stderr
    assert not list(out.glob("checkpoint-*")) and read_status(out)["state"] == "interrupted"
    check_output_dir(out, overwrite=False, resume=None, resume_request=None, resume_flag="--resume_from_checkpoint")


def test_an_interrupt_while_loading_leaves_a_folder_the_same_command_accepts(tiny_flux_dev_dir: Path,
                                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = _flux(tiny_flux_dev_dir, out, "--max_train_steps", "2", "--checkpointing_steps", "1")
    trainer = Trainer(command)
    trainer.wait_for(lambda: (out / "run_status.json").is_file(), "the run status")
    trainer.send(signal.SIGTERM)
    assert trainer.finish() == 128 + signal.SIGTERM
    assert "stopped by SIGTERM at once; nothing was trained yet; run the same command again" in trainer.stderr
    assert read_status(out)["state"] == "interrupted"
    assert run_cli(*command) == 0
    assert (out / "pytorch_lora_weights.safetensors").is_file() and read_status(out)["state"] == "finished"


@pytest.mark.parametrize("trial", [("the start", 0.3, 2.0, True), ("the run status", 0.0, 0.4, False),
                                   ("the run status", 0.4, 1.5, True)])
def test_ctrl_c_at_a_random_point_of_the_first_seconds_stops_in_one_message(trial: tuple, tiny_flux_dev_dir: Path,
                                                                             tmp_path: Path) -> None:
    """While the libraries are imported (a KeyboardInterrupt raised into numpy's import left it half made: a
    RecursionError traceback), while models load and caches fill, and in the first steps; also in a trainer
    started with SIGINT ignored. Always one message, exit 130, and a folder the same command accepts."""
    after, low, high, sigint_ignored = trial
    delay = random.uniform(low, high)
    out = tmp_path / "out"
    command = _flux(tiny_flux_dev_dir, out, "--max_train_steps", "1000", "--checkpointing_steps", "0")
    trainer = Trainer(command, sigint_ignored=sigint_ignored)
    if after == "the run status":
        trainer.wait_for(lambda: (out / "run_status.json").is_file(), "the run status")
    time.sleep(delay)
    trainer.send(signal.SIGINT)
    code = trainer.finish()
    said = f"SIGINT {delay:.2f} s after {after}: {trainer.stderr[-3000:]}"
    assert code == 130 and "Traceback" not in trainer.stderr, said
    last = trainer.stderr.strip().splitlines()[-1]
    assert last.startswith(("stopped by SIGINT", "  dreamstep train flux-lora --config")), said
    assert not (out / LOCK_FILE).exists()
    if list(out.glob("checkpoint-*")):
        assert read_status(out)["state"] == "interrupted" and "continue with:" in trainer.stderr, said
    else:
        check_output_dir(out, overwrite=False, resume=None, resume_request=None,
                         resume_flag="--resume_from_checkpoint")


@pytest.mark.parametrize("closed", ["stdout", "stdout and stderr"])
def test_ctrl_c_with_a_closed_output_pipe_keeps_the_checkpoint(closed: str, tiny_flux_dev_dir: Path,
                                                               tmp_path: Path) -> None:
    """``dreamstep train ... | tee log`` and Ctrl-C: tee ends at once, and every later write to the pipe fails
    (was: no checkpoint, the run "failed" with "[Errno 32] Broken pipe")."""
    out = tmp_path / "out"
    reader, writer = os.pipe()
    # 2>&1 | tee: the trainer's stderr goes to the same pipe
    trainer = Trainer(_flux(tiny_flux_dev_dir, out, "--max_train_steps", "1000", "--checkpointing_steps", "0"),
                      stdout=writer, stderr=writer if closed == "stdout and stderr" else subprocess.PIPE)
    os.close(writer)
    trainer.wait_for(lambda: _step(out) >= 2, "step 2")
    os.close(reader)
    trainer.send(signal.SIGINT)
    assert trainer.finish() == 130
    status = read_status(out)
    assert status["state"] == "interrupted" and status["checkpoint"] == f"checkpoint-{status['step']}"
    log = (out / "train.log").read_text()
    assert f"saved {out / status['checkpoint']}" in log and f"stopped by SIGINT at step {status['step']}" in log
    if closed == "stdout":
        command = shlex.split(trainer.stderr.split("continue with:\n")[1].splitlines()[0])
        assert run_cli(*command[1:], "--max_train_steps", status["step"] + 1) == 0
        assert read_status(out)["state"] == "finished"
        assert f"resuming from {out / status['checkpoint']}" in (out / "train.log").read_text()


def _no_room_after_the_first_checkpoint(monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    """Free space: half of what the first checkpoint took, once it is written."""
    real, first = disk.free_bytes, out / "checkpoint-2"
    monkeypatch.setattr(disk, "free_bytes", lambda path: sum(f.stat().st_size for f in first.iterdir()) // 2
                        if first.is_dir() else real(path))


def _fail_second_save(out: Path, write_then_fail):
    def writer(real):
        def write(obj, path, *args, **kwargs):
            if (out / "checkpoint-2").is_dir():
                write_then_fail(obj, path, real)
            return real(obj, path, *args, **kwargs)
        return write
    return writer


def _torch_save_hits_enospc(monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    def fail(obj, path, real):
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(checkpoint_module.torch, "save", _fail_second_save(out, fail)(torch.save))


def _safetensors_hits_os_error_28(monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    def fail(tensors, path, real):
        Path(path).write_bytes(b"\0" * 100)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')
    monkeypatch.setattr(checkpoint_module, "save_file", _fail_second_save(out, fail)(checkpoint_module.save_file))


@pytest.mark.parametrize("full_disk", [_no_room_after_the_first_checkpoint, _torch_save_hits_enospc,
                                       _safetensors_hits_os_error_28])
def test_a_full_disk_stops_with_one_line_and_keeps_the_last_checkpoint(full_disk, tiny_flux_dev_dir: Path,
                                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    with monkeypatch.context() as patches:
        full_disk(patches, out)
        assert run_cli(*_flux(tiny_flux_dev_dir, out, "--max_train_steps", "4", "--checkpointing_steps", "2")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: the disk is full: checkpoint-4 needs about ")
    assert (f"B in {out}, which has " in lines[-1]
            and f"the last good checkpoint, {out / 'checkpoint-2'}, is kept" in lines[-1])
    assert [p.name for p in out.glob("*checkpoint-*")] == ["checkpoint-2"]  # no half-written folder left
    assert read_status(out)["state"] == "failed"
    command = shlex.split(lines[-1].rsplit("and run again: ", 1)[1])
    assert run_cli(*command[1:]) == 0  # the kept checkpoint loads and the run completes
    assert f"resuming from {out / 'checkpoint-2'} (step 2)" in capsys.readouterr().out


@pytest.mark.parametrize("trainer, flag", [("flux-lora", "--resume_from_checkpoint"), ("sdxl-lora", "--resume")])
@pytest.mark.parametrize("files", [{"config.toml": "rank = 4\n", "my_lora.safetensors": "x", "notes.txt": "mine"},
                                   {"notes.txt": "mine"}, {"old/picture.png": "x"}])
def test_a_resume_with_no_checkpoint_never_touches_the_users_files(
        trainer: str, flag: str, files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in out.rglob("*")}
    data = ("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT) if trainer == "flux-lora" else (
        "--train_data_dir", tmp_path, "--resolution", "64")
    assert run_cli("train", trainer, "--pretrained_model_name_or_path", tmp_path / "model", "--output_dir", out,
                   *data, flag, "latest") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag} latest: {out} holds no checkpoint to resume") and "\n" not in err
    assert {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in out.rglob("*")} == before


def test_a_second_run_in_a_busy_folder_gets_one_line_naming_the_first_and_a_dead_ones_lock_is_taken_over(
        tiny_flux_dev_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    first = Trainer(_flux(tiny_flux_dev_dir, out, "--max_train_steps", "1000", "--checkpointing_steps", "0"))
    try:
        first.wait_for(lambda: (out / LOCK_FILE).is_file() and _step(out) >= 1, "the first run's step 1")
        holder = json.loads((out / LOCK_FILE).read_text())
        for resume in ((), ("--resume_from_checkpoint", "latest")):
            assert run_cli(*_flux(tiny_flux_dev_dir, out, "--max_train_steps", "2", *resume)) == 2
            err = capsys.readouterr().err.strip()
            started = time.strftime('%H:%M:%S', time.localtime(holder['started_at']))
            assert err == (f"error: --output_dir {out} is in use by another run (process {first.process.pid} on "
                           f"{holder['host']}, started {started}); wait for it to end, or pick another folder")
        first.process.kill()  # a killed run leaves its lock file (and here a save it had begun): the next run
        first.finish()        # takes the lock over and removes the unfinished save
        unfinished = out / f".checkpoint-6.tmp-{first.process.pid}"
        unfinished.mkdir()
        (unfinished / "optimizer.pt").write_bytes(b"half")
        assert (out / LOCK_FILE).is_file()
        assert run_cli(*_flux(tiny_flux_dev_dir, out, "--max_train_steps", "2")) == 0
        assert (f"note: process {first.process.pid} ended here without finishing; took over its lock and removed "
                f"its unfinished save {unfinished.name}\n") in capsys.readouterr().out
        assert not list(out.glob(".*"))
    finally:
        first.process.kill()
        first.finish()


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan"])
def test_a_skipped_steps_share_outside_0_to_1_is_refused_in_one_line(value: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    assert run_cli(*_flux(tmp_path / "model", out, "--on_nonfinite_loss", "skip",
                          f"--max_skipped_steps_fraction={value}")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --max_skipped_steps_fraction") and "\n" not in err
    assert not out.exists()


def test_an_abort_that_a_library_turns_into_its_own_error_still_ends_as_the_signal(monkeypatch, capsys) -> None:
    """diffusers wraps whatever a pipeline module's import raises (onnxruntime's, when a SIGTERM lands in it) in a
    RuntimeError: the command still ends as the signal, with its message and exit code, not a traceback."""
    from dreamstep import cli
    from dreamstep.engine.interrupt import StopSignals

    def loading(key, command, args) -> None:
        signals = StopSignals()
        signals.hint = "nothing was trained yet"
        signals.install()
        try:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
            except KeyboardInterrupt:
                raise RuntimeError("Failed to import diffusers.pipelines.onnx_utils: initialization failed") from None
        finally:
            signals.uninstall()

    monkeypatch.setattr(cli, "_run", loading)
    assert cli.main(["plan"]) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM at once; nothing was trained yet" in capsys.readouterr().err


def test_a_signal_while_libraries_import_waits_for_the_import_and_more_signals_never_cut_the_cleanup() -> None:
    """Handlers of a command (in process: the same object a trainer runs with). A first signal in a held block lets
    the block end (an import cut in the middle leaves a library half made) and then stops; once stopping at once,
    signals pressed again do not interrupt the cleanup that follows."""
    from dreamstep.engine.interrupt import RunInterrupted, StopSignals

    signals = StopSignals()
    signals.install()
    try:
        finished = False
        with pytest.raises(RunInterrupted, match="^stopped by SIGINT before the run started$"):
            with signals.held("stopping once the libraries have loaded"):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler has run, and returned
                finished = True
        assert finished
        cleaned_up = False
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        cleaned_up = True
        assert cleaned_up and signals.exit_code == 130
    finally:
        signals.uninstall()
