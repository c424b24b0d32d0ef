"""The benchmark scripts still run. ``benchmarks/flux_matrix.py --size smoke`` is its whole matrix (every base
mode, with and without block swapping and regional compilation) on the tiny test model's widths; the script
itself fails when a row's transformer outlives the row, so a pass also proves that the rows run in isolation."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def label(mode: str, offload: bool, compiled: bool) -> str:
    """A row's label as flux_matrix.py prints it (Row.label) at 32², batch 1."""
    return f"{mode:<5}{' offload' if offload else '':<9}{' compile' if compiled else '':<9}{32:>5}² b1"


def test_the_flux_matrix_runs_every_row_in_isolation() -> None:
    proc = subprocess.run([sys.executable, "flux_matrix.py", "--size", "smoke", "--compile", "both",
                           "--compile_backend", "aot_eager"], cwd=BENCHMARKS, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    reference = [line for line in lines if line.startswith("  reference")]
    assert len(reference) == 1 and float(reference[0].split(")", 1)[1].split()[0]) > 0
    for mode, offload, compiled in itertools.product(["bf16", "fp8", "int8", "nf4"], [False, True], [False, True]):
        rows = [line[36:] for line in lines if line.startswith("  " + label(mode, offload, compiled))]
        assert len(rows) == 1, (mode, offload, compiled, proc.stdout)
        timed = rows[0].split()[0].replace(".", "", 1).isdigit()
        if mode == "bf16" or (mode in ("fp8", "int8") and not compiled):  # these run on every machine
            assert timed and float(rows[0].split()[0]) > 0, rows[0]
        else:
            assert timed or rows[0].split()[0] in ("needs", "torch.compile"), rows[0]
