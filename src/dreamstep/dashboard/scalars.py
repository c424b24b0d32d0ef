"""A run's scalars (loss, lr, ...) for the dashboard, followed incrementally.

The source is ``train.log``, which the trainer's :class:`~dreamstep.engine.logging.TrainingLogger` writes
beside the TensorBoard files: one line per step. A run without it (written before it existed) is read from
its TensorBoard event files with TensorBoard's own loader. Both are followed from the last offset, so a
refresh of a live run reads only what was appended, and a partial last line or record waits for the next
refresh. TensorBoard's reader checks every record's CRC in pure Python (about 1 ms per step), so
``train.log`` is what keeps a 100k-step run fast: see ``benchmarks/dashboard_scalars.py``.

Curves are cut down on the server to a few thousand points by min/max decimation, which keeps every spike
visible at screen resolution.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RunScalars", "Series", "decimate", "find_event_files"]

EVENT_GLOB = "events.out.tfevents.*"
TEXT_LOG = "train.log"

READ_CHUNK_BYTES = 4 * 2**20
SMOOTHING = 0.9  # the weight of loss_curve.png and of TensorBoard's default slider


def _column(typecode: str) -> Callable[[], array]:
    return lambda: array(typecode)


@dataclass
class Series:
    """One scalar tag: steps, values, the wall time each was written, and the smoothed values (the
    debiased moving average of :func:`~dreamstep.engine.logging.smooth`, kept up to date point by point).
    Columns are packed arrays (8 bytes a number, not a Python object), so a server holding a long run's
    scalars stays small; ``numpy.asarray`` reads them without a copy."""

    steps: array = field(default_factory=_column("q"))
    values: array = field(default_factory=_column("d"))
    wall_times: array = field(default_factory=_column("d"))
    _ema: array = field(default_factory=_column("d"))  # the moving average after each point
    _norm: array = field(default_factory=_column("d"))  # and its debiasing weight

    @property
    def smoothed(self) -> np.ndarray:
        ema, norm = np.asarray(self._ema), np.asarray(self._norm)
        return np.divide(ema, norm, out=np.asarray(self.values, dtype=np.float64).copy(), where=norm != 0)

    def add(self, step: int, value: float, wall_time: float) -> None:
        """Append a point. A step at or before the last one means the run resumed from an earlier
        checkpoint: the points it repeats are dropped, as TensorBoard does."""
        if self.steps and step <= self.steps[-1]:
            keep = bisect.bisect_left(self.steps, step)
            for column in (self.steps, self.values, self.wall_times, self._ema, self._norm):
                del column[keep:]
        ema, norm = (self._ema[-1], self._norm[-1]) if self._ema else (0.0, 0.0)
        if math.isfinite(value):  # a NaN step must not poison every later smoothed value
            ema, norm = SMOOTHING * ema + (1 - SMOOTHING) * value, SMOOTHING * norm + (1 - SMOOTHING)
        self._ema.append(ema)
        self._norm.append(norm)
        self.steps.append(step)
        self.values.append(value)
        self.wall_times.append(wall_time)

    def seconds_per_step(self, window: int = 50) -> float | None:
        """Wall time per step over the last ``window`` steps."""
        steps, times = self.steps[-window:], self.wall_times[-window:]
        if len(steps) < 2 or steps[-1] <= steps[0]:
            return None
        return (times[-1] - times[0]) / (steps[-1] - steps[0])


def find_event_files(folder: Path, depth: int = 2) -> list[Path]:
    """Event files in ``folder`` and up to ``depth`` levels of subfolders (Kohya's ``logging_dir``
    layout), oldest first by name (their names start with the creation time)."""
    found: list[Path] = []
    level = [folder]
    for _ in range(depth + 1):
        found += [p for d in level for p in d.glob(EVENT_GLOB) if p.is_file()]
        level = [c for d in level for c in d.iterdir() if c.is_dir() and not c.name.startswith(".")
                 and not c.name.startswith("checkpoint")]
    return sorted(found, key=lambda p: (p.name, str(p)))


class RunScalars:
    """The scalars of one run folder, kept up to date by :meth:`refresh`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.series: dict[str, Series] = {}
        self.evaluation: dict[int, dict[str, float]] = {}  # step -> scores, from train.log's "eval" lines
        self.source = ""
        self._text_offset = 0
        self._loaders: dict[Path, Any] = {}
        self._seconds: dict[str, float] = {}  # "YYYY-MM-DD HH:MM:SS" -> epoch seconds
        self._lock = threading.Lock()

    def refresh(self) -> dict[str, Series]:
        """Read what was appended since the last call; return the series by tag."""
        with self._lock:
            log = self.folder / TEXT_LOG
            if log.is_file():
                self._read_text_log(log)
            else:
                self._read_event_files()
            return self.series

    def _read_text_log(self, path: Path) -> None:
        """Parse the complete lines appended since the last read, a chunk at a time (a 100 MB log never
        sits in memory whole)."""
        self.source = TEXT_LOG
        with open(path, "rb") as f:
            if f.seek(0, 2) < self._text_offset:  # replaced by a new run (--overwrite_output_dir)
                self.series, self.evaluation, self._text_offset = {}, {}, 0
            f.seek(self._text_offset)
            while data := f.read(READ_CHUNK_BYTES):
                complete = data[:data.rfind(b"\n") + 1]
                if not complete:
                    if len(data) < READ_CHUNK_BYTES:
                        break  # a line still being written
                    complete = data  # one line longer than a chunk: not a step line, skip it
                self._text_offset += len(complete)
                f.seek(self._text_offset)
                self._parse_lines(complete.decode("utf-8", errors="replace"))

    def _parse_lines(self, text: str) -> None:
        for line in text.splitlines():
            # "2026-11-23 08:30:01.123 step 12 loss=0.1 lr=0.0003", "... eval 200 val_loss=0.2 dino=0.5";
            # other lines are messages.
            fields = line.split(" ")
            if len(fields) < 5 or fields[2] not in ("step", "eval") or not fields[3].isdigit():
                continue
            if fields[2] == "eval":
                self.evaluation[int(fields[3])] = dict(_pairs(fields[4:]))
                continue
            wall_time = self._wall_time(fields[0], fields[1])
            if wall_time is None:
                continue
            step = int(fields[3])
            for tag, value in _pairs(fields[4:]):
                self._series(tag).add(step, value, wall_time)

    def _series(self, tag: str) -> Series:
        if tag not in self.series:
            self.series[tag] = Series()
        return self.series[tag]

    def _wall_time(self, day: str, clock: str) -> float | None:
        """Epoch seconds of a ``train.log`` time; each second is parsed once (100k lines share a few)."""
        second = f"{day} {clock[:8]}"
        if second not in self._seconds:
            try:
                self._seconds[second] = time.mktime(time.strptime(second, "%Y-%m-%d %H:%M:%S"))
            except ValueError:
                return None
        try:
            return self._seconds[second] + float(clock[8:] or 0)
        except ValueError:
            return None

    def _read_event_files(self) -> None:
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

        self.source = "TensorBoard"
        for path in find_event_files(self.folder):
            if path not in self._loaders:
                self._loaders[path] = LegacyEventFileLoader(str(path))
            for event in self._loaders[path].Load():
                self._add_event(event)

    def _add_event(self, event: Any) -> None:
        if not event.HasField("summary"):
            return
        for value in event.summary.value:
            if value.HasField("simple_value"):
                number = float(value.simple_value)
            elif value.HasField("tensor") and len(value.tensor.float_val) == 1:
                number = float(value.tensor.float_val[0])
            else:
                continue  # images and histograms
            tag = value.tag.removeprefix("train/")
            self._series(tag).add(int(event.step), number, float(event.wall_time))


def _pairs(fields: list[str]) -> list[tuple[str, float]]:
    """``name=value`` fields as (name, float); malformed ones are skipped."""
    out = []
    for field_text in fields:
        name, _, text = field_text.partition("=")
        try:
            out.append((name, float(text)))
        except ValueError:
            continue
    return out


def decimate(steps: list[int], values: list[float], max_points: int) -> tuple[list[int], list[float]]:
    """At most ``max_points`` points: each of ``max_points // 2`` equal runs of points gives its minimum
    and its maximum, in step order; shorter series come back unchanged. Non-finite values are dropped."""
    x, y = np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)
    finite = np.isfinite(y)
    x, y = x[finite], y[finite]
    if len(y) <= max_points:
        return x.tolist(), y.tolist()
    bins = max(1, max_points // 2)
    size = -(-len(y) // bins)
    pad = bins * size - len(y)
    # Pad with the last point, so the final short run keeps its true min and max.
    ys = np.concatenate([y, np.full(pad, y[-1])]).reshape(bins, size)
    xs = np.concatenate([x, np.full(pad, x[-1])]).reshape(bins, size)
    rows = np.arange(bins)
    lo, hi = ys.argmin(axis=1), ys.argmax(axis=1)
    first, second = np.minimum(lo, hi), np.maximum(lo, hi)
    out_x = np.stack([xs[rows, first], xs[rows, second]], axis=1).ravel()
    out_y = np.stack([ys[rows, first], ys[rows, second]], axis=1).ravel()
    return out_x.tolist(), out_y.tolist()
