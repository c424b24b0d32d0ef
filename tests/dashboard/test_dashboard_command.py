"""``dreamstep dashboard`` on the command line: bad input gets one error line; the server starts, serves,
and warns about a non-loopback address."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from dashboard_testkit import GrowingRun

from dreamstep.cli import main
from dreamstep.commands.dashboard import is_loopback

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("argv, message", [
    ([], "give at least one RUN_DIR"),
    (["no/such/folder"], "RUN_DIR no/such/folder: no such folder"),
    (["--dataset", "no/such.toml"], "--dataset no/such.toml: no such file or folder"),
    ([".", "--port", "70000"], "--port 70000"),
    ([".", "--host", "0.0.0.0", "--token", ""], "--token is empty, which would let anyone in"),
    ([".", "--token", "  "], "--token is empty"),
    ([".", "--data_root", "."], "--data_root is for --allow_training"),
    (["--dataset", ".", "--allow_training"], "--allow_training needs a RUN_DIR"),
    ([".", "--allow_training", "--data_root", "no/such/folder"], "--data_root no/such/folder: no such folder"),
])
def test_bad_input_is_one_error_line(argv, message, capsys):
    assert main(["dashboard", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ["127.0.0.1", "localhost", "::1", "127.1.2.3"])
    assert not any(is_loopback(h) for h in ["0.0.0.0", "192.168.1.5", "::", "example.com"])


def test_the_command_serves_and_warns_about_a_non_loopback_host(tmp_path):
    run = GrowingRun(tmp_path / "runs" / "live")
    run.add_steps(2)
    with __import__("socket").socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    (tmp_path / "pictures").mkdir()  # not a run, and holds none
    server = subprocess.Popen([sys.executable, "-m", "dreamstep", "dashboard", str(tmp_path / "runs"),
                               str(tmp_path / "pictures"), "--host",
                               "0.0.0.0", "--port", str(port), "--token", "abc"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert f"dashboard: http://0.0.0.0:{port}/?token=abc" in line
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs?token=abc", timeout=10) as r:
                    body = r.read().decode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert '"name":"live"' in body
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=10)
        assert refused.value.code == 401
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert "warning: --host 0.0.0.0 lets other machines open the dashboard" in err
    assert f"note: RUN_DIR {tmp_path / 'pictures'} holds no run yet" in err
    assert f"RUN_DIR {tmp_path / 'runs'} holds" not in err


def test_a_restarted_dashboard_listens_on_its_port_at_once_and_a_busy_port_is_one_line(tmp_path, capsys):
    """Its answers to ``Connection: close`` requests (urllib's) leave connections in TIME_WAIT on its port for a
    minute; the restart (jobs are built to survive one) must not wait for them."""
    from dashboard_testkit import DashboardProcess

    (tmp_path / "runs").mkdir()
    dashboard = DashboardProcess(tmp_path / "runs", [tmp_path])
    for _ in range(3):
        dashboard.api("/api/jobs")
    assert main(["dashboard", str(tmp_path / "runs"), "--port", str(dashboard.port)]) == 2
    assert (f"\nerror: --host 127.0.0.1 --port {dashboard.port}: cannot listen there (Address already in use); "
            "pick another --port\n") in capsys.readouterr().err
    dashboard.close()
    again = DashboardProcess(tmp_path / "runs", [tmp_path], port=dashboard.port)
    try:
        assert again.api("/api/jobs")["jobs"] == []
    finally:
        again.close()
