"""Scalars for the charts: smoothing as the loss-curve PNG draws it, decimation that keeps spikes, and
TensorBoard event files read when a run has no train.log."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from dreamstep.dashboard.scalars import RunScalars, Series, decimate
from dreamstep.engine.logging import TrainingLogger, smooth


def test_incremental_smoothing_equals_the_engine_smoothing():
    values = [1.0 / (1 + i) + 0.1 * math.sin(i) for i in range(500)]
    series = Series()
    for step, value in enumerate(values, start=1):
        series.add(step, value, 0.0)
    assert list(series.smoothed) == pytest.approx(smooth(values))


def test_decimation_keeps_every_extreme_and_the_size_limit():
    rng = np.random.default_rng(0)
    values = rng.normal(size=100_000).tolist()
    values[12_345], values[77_777] = 50.0, -50.0  # two spikes
    steps = list(range(1, len(values) + 1))
    xs, ys = decimate(steps, values, 2000)
    assert len(xs) == 2000 and xs == sorted(xs)
    assert (12_346, 50.0) in zip(xs, ys) and (77_778, -50.0) in zip(xs, ys)
    assert max(ys) == 50.0 and min(ys) == -50.0
    assert decimate([1, 2, 3], [1.0, float("nan"), 3.0], 10) == ([1, 3], [1.0, 3.0])


def test_event_files_are_read_when_there_is_no_train_log(tmp_path):
    logger = TrainingLogger(tmp_path)
    for step in range(1, 6):
        logger.log(step, {"loss": 0.1 * step, "lr": 1e-3})
    logger.close()
    (tmp_path / "train.log").unlink()
    scalars = RunScalars(tmp_path)
    series = scalars.refresh()
    assert scalars.source == "TensorBoard"
    assert list(series["loss"].steps) == [1, 2, 3, 4, 5]
    assert list(series["loss"].values) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert list(series["lr"].values) == pytest.approx([1e-3] * 5)


def test_a_long_log_is_read_in_chunks_into_packed_columns(tmp_path, monkeypatch):
    """A server following a long run keeps its memory small: the log is parsed a chunk at a time and each
    point costs a few packed numbers, not Python objects (tracemalloc sees both)."""
    steps = 60_000
    with open(tmp_path / "train.log", "w") as f:
        f.write("2026-11-25 08:30:00.000 " + "x" * 300 + "\n")  # a message line longer than a chunk
        for step in range(1, steps + 1):
            f.write(f"2026-11-25 08:30:01.123 step {step} loss={1 / step:.6g} lr=0.0001 grad_norm=1 loss_scale=1\n")
        f.write("2026-11-25 08:30:02.000 step 60001 loss=0.5")  # still being written
    monkeypatch.setattr("dreamstep.dashboard.scalars.READ_CHUNK_BYTES", 256)
    scalars = RunScalars(tmp_path)
    tracemalloc.start()
    series = scalars.refresh()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sorted(series) == ["grad_norm", "loss", "loss_scale", "lr"]
    assert list(series["loss"].steps) == list(range(1, steps + 1))
    assert series["loss"].values[-1] == pytest.approx(1 / steps, rel=1e-5)
    assert peak < 4 * steps * 64
    with open(tmp_path / "train.log", "a") as f:
        f.write(" lr=0.0001\n")
    assert scalars.refresh()["loss"].steps[-1] == steps + 1
