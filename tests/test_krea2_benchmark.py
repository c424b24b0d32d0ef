"""``benchmarks/krea2_lora.py`` still runs on the tiny model and prints its rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_krea2_benchmark_prints_both_loops() -> None:
    proc = subprocess.run([sys.executable, "krea2_lora.py", "--resolution", "32", "--steps", "2", "--warmup", "1"],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(BENCHMARKS.parent / "src")},
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line[2:46].strip(): line[46:].split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert float(rows["reference (the script: VAE every step)"][0]) > 0
    assert float(rows["dreamstep step (cached latents)"][2].rstrip("x")) > 0
