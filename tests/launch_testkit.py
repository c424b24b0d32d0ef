"""Runs a script or module under ``accelerate launch`` with several CPU processes (gloo), as users launch
multi-GPU runs: ``--multi_gpu`` selects the torchrun launcher (``--cpu --num_processes 2`` would need
mpirun), and each worker's Accelerator then talks gloo on the CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(*target: object, processes: int = 2, hf_home: Path | None = None, pythonpath: Path | None = None,
                      timeout: int = 300) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``target`` (a script and its arguments, or ``-m module ...``); asserts that it
    succeeded. ``hf_home`` keeps a user's accelerate config out; ``pythonpath`` goes before the inherited one."""
    # PYTHONFAULTHANDLER: a rank that crashes in native code prints its Python stack.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    if hf_home is not None:
        env["HF_HOME"] = str(hf_home)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
        str(free_port())]
    proc = subprocess.run([*launcher, *map(str, target)], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
