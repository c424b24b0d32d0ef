"""Jobs from start to end through the API of a real ``dreamstep dashboard --allow_training`` process on the
tiny FLUX model: one running job per device and the next one queued, sample now, stop (a checkpoint is
written, the run is interrupted), resume to the end, and a dashboard restarted with a job running and one
queued that follows both to their end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

from dashboard_testkit import ROBOT_DIR, DashboardProcess

from dreamstep.engine.run_folder import SAMPLE_REQUEST, read_status

STEPS = 30  # for the first job: enough that the test pauses it before it ends, however fast steps are


def _job(name: str, steps: int) -> dict:
    return {"trainer": "flux-lora", "output_root": 0, "name": name,
            "options": {"pretrained_model_name_or_path": "flux-dev", "instance_data_dir": "robot",
                        "instance_prompt": "a photo of sks robot", "resolution": 32, "rank": 4,
                        "max_train_steps": steps, "validation_prompt": "sks robot", "validation_steps": 1000,
                        "num_validation_images": 1, "validation_inference_steps": 1, "report_to": "none",
                        "logging_steps": 1}}  # the status file has the step at every step


def _stepped(job: dict) -> bool:
    status = read_status(Path(job["output_dir"])) or {}
    return job["state"] == "running" and status.get("step", 0) >= 1


def test_jobs_queue_stop_resume_and_survive_a_dashboard_restart(tmp_path, tiny_flux_dev_dir):
    runs = tmp_path / "runs"
    runs.mkdir()
    dashboard = DashboardProcess(runs, [tiny_flux_dev_dir.parent, ROBOT_DIR.parent])
    pids: set[int] = set()
    try:
        first = dashboard.post("/api/jobs", _job("first", STEPS))["job"]
        second = dashboard.post("/api/jobs", _job("second", 2))["job"]
        assert (first["state"], second["state"]) == ("running", "queued")  # one running job per device
        folder = Path(first["output_dir"])
        pids.add(first["pid"])

        dashboard.wait_job(first["id"], _stepped, "to train a step")
        # The trainer is paused while both requests are sent, so they land between the same two steps however
        # fast the steps are: the step it is in samples (validation_steps is far off) and then stops.
        os.kill(first["pid"], signal.SIGSTOP)
        dashboard.post(f"/api/jobs/{first['id']}/sample")
        dashboard.post(f"/api/jobs/{first['id']}/stop")
        os.kill(first["pid"], signal.SIGCONT)
        stopped = dashboard.wait_job(first["id"], lambda j: j["state"] != "running", "to stop")
        status = read_status(folder)
        assert stopped["state"] == "stopped" and stopped["exit_code"] == 128 + signal.SIGINT
        assert status["state"] == "interrupted" and status["step"] < STEPS
        assert (folder / f"checkpoint-{status['step']}").is_dir()
        assert [p.name for p in (folder / "samples").iterdir()] == [f"validation-{status['step']:06d}.png"]
        assert not (folder / SAMPLE_REQUEST).exists()
        assert "continue with" in stopped["message"]

        second = dashboard.wait_job(second["id"], lambda j: j["state"] != "queued", "to start after the first")
        pids.add(second["pid"])
        resumed = dashboard.post(f"/api/jobs/{first['id']}/resume")["job"]
        assert resumed["state"] == "queued" and resumed["command"][-2:] == ["--resume_from_checkpoint", "latest"]

        dashboard.close()  # second running, first queued
        assert _alive(second["pid"])
        dashboard = DashboardProcess(runs, [tiny_flux_dev_dir.parent, ROBOT_DIR.parent])
        jobs = {j["id"]: j for j in dashboard.api("/api/jobs")["jobs"]}
        assert [jobs[first["id"]]["state"], jobs[second["id"]]["state"]] == ["queued", "running"]

        finished = dashboard.wait_job(second["id"], lambda j: j["state"] in ("finished", "failed"), "to end")
        assert finished["state"] == "finished", finished["message"]
        done = dashboard.wait_job(first["id"], lambda j: j["state"] in ("finished", "failed"), "to end")
        pids.add(done["pid"])
        assert done["state"] == "finished", done["message"]
        assert read_status(folder)["step"] == STEPS
        log = dashboard.api(f"/api/jobs/{first['id']}/log")["log"]
        assert any(f"checkpoint-{status['step']}" in line and "resum" in line for line in log), log[-20:]
        assert (folder / "pytorch_lora_weights.safetensors").is_file()
        assert json.loads((folder / "run_status.json").read_text())["state"] == "finished"
    finally:
        dashboard.close()
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return b"dreamstep" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
