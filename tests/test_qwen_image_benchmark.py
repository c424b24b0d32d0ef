"""``benchmarks/qwen_image_lora.py`` still runs: its three rows (the script's loop, dreamstep's step, the script's
loop without its VAE) are timed, on a small resolution."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_qwen_image_benchmark_times_both_loops() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "qwen_image_lora.py", "--resolution", "64", "--steps", "2",
                           "--warmup", "1"], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line[2:46].strip(): line[46:].split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert float(rows["reference (the script: VAE every step)"][0]) > 0
    assert rows["dreamstep step (cached latents)"][-1].endswith("x")
