"""The benchmark scripts still run. ``benchmarks/flux_matrix.py --size smoke`` is its whole matrix (every base
mode, with and without block swapping and regional compilation) on the tiny test model's widths; the script
itself fails when a row's transformer outlives the row, so a pass also proves that the rows run in isolation."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)


def table_rows(table: str) -> dict[str, list[str]]:
    """The markdown table's rows by label: [s/step, peak, reserved, plan, peak / plan, note]."""
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ") and "²" in line]
    return {cells[0].strip(): [cell.strip() for cell in cells[1:]] for cells in rows}


def test_the_gpu_check_smoke_run_measures_its_rows_beside_the_plan(tmp_path: Path) -> None:
    table = tmp_path / "check.md"
    proc = run_benchmark("gpu_check.py", "--smoke", "--budget", "150", "--table", str(table))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table_rows(table.read_text())
    swapped = [f"FLUX.1-dev {mode}, swap 1, 64²" for mode in ("bf16", "fp8")]
    measured = [f"FLUX.1-dev {mode}, 64²" for mode in ("bf16", "fp8")] + swapped + ["SDXL bf16, 64²"]
    for label in measured:  # the first rows, which every CPU runs within the budget
        seconds, peak, reserved, plan, ratio, note = rows[label]
        assert float(seconds) > 0 and float(peak) > 0 and float(plan) > 0, (label, rows[label])
        assert float(ratio) == pytest.approx(float(peak) / float(plan), rel=0.01)
    assert len(rows) == 13
    for label, cells in rows.items():  # the others: measured, or skipped with the reason
        assert cells[0] or cells[-1].startswith("skipped: "), (label, cells)


def test_a_failing_row_is_reported_in_its_row_and_the_check_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check
    import torch

    arch = gpu_check.Architecture.smoke()
    gpu_check.write_configs(tmp_path, arch.transformer, smoke=True)
    setup = gpu_check.Setup(torch.device("cpu"), True, 1, tmp_path, gpu_check.Run(arch, (1, 1), None,
                                                                                  torch.device("cpu"), 0, 0, ""))
    clock = gpu_check.Clock(600, first_build=5)
    plans = gpu_check.Plans(tmp_path, "cpu")
    failed = gpu_check.run_check(setup, gpu_check.Check("flux", "bf16", 32, blocks_to_swap=5), clock, plans)
    assert failed.seconds is None and failed.note.startswith("failed: UserError: --blocks_to_swap 5: "), failed.note
    measured = gpu_check.run_check(setup, gpu_check.Check("flux", "bf16", 32), clock, plans)
    assert measured.seconds > 0 and measured.plan > 0, measured


def test_the_sdxl_benchmark_runs_its_three_loops() -> None:
    proc = run_benchmark("sdxl_lora.py", "--steps", "1", "--warmup", "0", "--resolution", "32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("  reference", "  dreamstep"))]
    assert len(rows) == 3 and all(float(row.split()[-3]) > 0 for row in rows), proc.stdout


def test_the_quantized_base_cache_benchmark_reads_the_base_back() -> None:
    proc = run_benchmark("quantized_base_cache.py", "--width", "256", "--double", "1", "--single", "1", "--modes",
                         "int8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [line.split() for line in proc.stdout.splitlines() if line.startswith("int8 ")]
    assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[4]) > 0, proc.stdout


def test_the_quantized_step_benchmark_shows_a_bf16_stream_for_every_base() -> None:
    pytest.importorskip("torchao")
    proc = run_benchmark("quantized_step_dtypes.py", "--width", "256", "--resolution", "64", "--text_tokens", "16",
                         "--modes", "none", "int8", "--no-full_size_plan")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The step's rows: base, the transformer's input dtype, the stream's, step MiB, plan MiB, plan/step, s/step.
    rows = {cells[0]: cells for cells in map(str.split, proc.stdout.splitlines()) if len(cells) == 7}
    assert rows["none"][1:3] == rows["int8"][1:3] == ["bfloat16", "bfloat16"]
    assert float(rows["int8"][5]) >= 1.0  # the plan holds the step
