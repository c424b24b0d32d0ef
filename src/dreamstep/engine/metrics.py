"""Evaluation scores over training steps: a table of ``step -> {metric: value}``, written as
``metrics.csv`` (header ``step,<metric>,...``) and drawn as ``metrics.png`` (one panel per metric).

Used by the trainers at their validation points and by ``dreamstep eval`` over checkpoint files.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from dreamstep.files import atomic_path, write_text_atomic

__all__ = ["LOWER_IS_BETTER", "MetricsTable", "draw_metrics", "higher_is_better"]

LOWER_IS_BETTER = frozenset({"val_loss"})


def higher_is_better(metric: str) -> bool:
    """Losses fall as a model improves; similarity scores rise."""
    return metric not in LOWER_IS_BETTER


@dataclass
class MetricsTable:
    """Scores per step, in the order they were added; a step scored twice keeps its last scores."""

    rows: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, step: int, scores: Mapping[str, float]) -> None:
        self.rows.setdefault(int(step), {}).update({k: float(v) for k, v in scores.items()})

    @property
    def names(self) -> list[str]:
        """Metric names in first-seen order."""
        return list(dict.fromkeys(name for row in self.rows.values() for name in row))

    def series(self, metric: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one metric, by step, finite values only."""
        return [(s, r[metric]) for s, r in sorted(self.rows.items()) if math.isfinite(r.get(metric, math.nan))]

    def best(self, metric: str) -> tuple[int, dict[str, float]] | None:
        """The step with the best value of ``metric`` (earliest on ties) and its scores."""
        points = self.series(metric)
        if not points:
            return None
        sign = 1.0 if higher_is_better(metric) else -1.0
        step = max(points, key=lambda p: (sign * p[1], -p[0]))[0]
        return step, self.rows[step]

    def state(self) -> list[list]:
        """A JSON-friendly copy (what a checkpoint stores)."""
        return [[step, dict(row)] for step, row in sorted(self.rows.items())]

    @classmethod
    def from_state(cls, state: Sequence[Sequence]) -> MetricsTable:
        table = cls()
        for step, row in state:
            table.add(int(step), row)
        return table

    def write_csv(self, path: str | Path) -> Path:
        """``step,<metric>,...`` with one row per step; a metric missing at a step is left empty."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        names = self.names
        text = io.StringIO(newline="")
        writer = csv.writer(text)
        writer.writerow(["step", *names])
        for step, row in sorted(self.rows.items()):
            writer.writerow([step, *(f"{row[n]:.6g}" if n in row else "" for n in names)])
        write_text_atomic(path, text.getvalue())
        return path


_PANEL = (420, 240)
_MARGIN = (64, 28, 16, 36)  # left, top, right, bottom inside a panel
_LINE, _AXES = (20, 70, 170), (60, 60, 60)


def draw_metrics(table: MetricsTable, path: str | Path, columns: int = 2,
                 marks: Mapping[str, int] | None = None) -> Path:
    """One panel per metric (value against step, with tick labels); ``marks`` circles a step in a panel
    (e.g. the best one). Saved as a PNG at ``path``."""
    names = table.names or ["(no metrics)"]
    columns = min(columns, len(names))
    rows = math.ceil(len(names) / columns)
    image = Image.new("RGB", (columns * _PANEL[0], rows * _PANEL[1]), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for i, name in enumerate(names):
        origin = ((i % columns) * _PANEL[0], (i // columns) * _PANEL[1])
        arrow = "higher is better" if higher_is_better(name) else "lower is better"
        _panel(draw, font, origin, f"{name} ({arrow})", table.series(name), (marks or {}).get(name))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as partial:
        image.save(partial, format="PNG")
    return path


def _panel(draw: ImageDraw.ImageDraw, font: ImageFont.ImageFont, origin: tuple[int, int], title: str,
           points: list[tuple[int, float]], mark: int | None) -> None:
    ox, oy = origin
    left, top = ox + _MARGIN[0], oy + _MARGIN[1]
    right, bottom = ox + _PANEL[0] - _MARGIN[2], oy + _PANEL[1] - _MARGIN[3]
    draw.text((left, oy + 8), title, fill=_AXES, font=font)
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=_AXES)
    if not points:
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = (max(ys) - min(ys)) * 0.1 or abs(ys[0]) * 0.1 or 1.0
    y0, y1 = min(ys) - pad, max(ys) + pad

    def px(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    for y in (min(ys), (min(ys) + max(ys)) / 2, max(ys)):
        draw.text((ox + 4, px(x0, y)[1] - 6), f"{y:.4g}", fill=_AXES, font=font)
        draw.line([(left - 4, px(x0, y)[1]), (left, px(x0, y)[1])], fill=_AXES)
    for x in sorted({x0, max(xs), round((x0 + max(xs)) / 2)}):
        draw.text((px(x, y0)[0] - 3 * len(str(x)), bottom + 6), str(x), fill=_AXES, font=font)
    draw.text((right - 24, bottom + 20), "step", fill=_AXES, font=font)
    pixels = [px(x, y) for x, y in points]
    if len(pixels) > 1:
        draw.line(pixels, fill=_LINE, width=2)
    for x, y in pixels:
        draw.ellipse([x - 2.5, y - 2.5, x + 2.5, y + 2.5], fill=_LINE)
    if mark is not None and mark in xs:
        x, y = pixels[xs.index(mark)]
        draw.ellipse([x - 6, y - 6, x + 6, y + 6], outline=(200, 60, 30), width=2)
