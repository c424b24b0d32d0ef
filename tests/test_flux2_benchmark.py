"""benchmarks/flux2_lora.py runs both loops (the klein script's and dreamstep's) on the tiny model and prints them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def test_the_flux2_benchmark_runs_both_loops() -> None:
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])  # this checkout's dreamstep
    proc = subprocess.run([sys.executable, "flux2_lora.py", "--steps", "1", "--warmup", "0", "--resolution", "32"],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("  diffusers", "  dreamstep"))]
    assert len(rows) == 2 and float(rows[0][-2]) > 0 and float(rows[1][-3]) > 0, proc.stdout
