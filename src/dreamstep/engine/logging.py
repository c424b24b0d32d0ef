"""Training logs: TensorBoard scalars, the loss history, a plain-text ``train.log``, a loss-curve PNG and
image grids, all with Pillow.

TensorBoard is optional: with ``report_to="none"``, or when the ``tensorboard`` package is missing (one
warning), scalars are still kept in memory and the loss curve is still drawn. Only the main process writes.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from tqdm.auto import tqdm

from dreamstep.engine.metrics import MetricsTable, draw_metrics
from dreamstep.png_text import JSON_KEY, grid_png_info

__all__ = ["TrainingLogger", "draw_loss_curve", "log_time", "save_image_grid", "say", "say_before_the_run", "smooth",
           "take_said_before_the_run"]

ReportTo = Literal["tensorboard", "none"]


class TrainingLogger:
    """Scalars to TensorBoard, memory and ``train.log``; validation image grids; ``loss_curve.png`` on
    :meth:`close`.

    ``log_dir`` receives the TensorBoard event files, ``samples/``, ``train.log`` (one line per step and
    every message of the run, appended across resumes, so a dashboard or ``tail -f`` can follow it) and
    ``loss_curve.png``.
    """

    def __init__(self, log_dir: str | Path, *, report_to: ReportTo = "tensorboard",
                 is_main_process: bool = True, tensorboard_dir: str | Path | None = None,
                 samples_dir: str | Path | None = None, purge_step: int | None = None) -> None:
        """``tensorboard_dir`` puts the event files elsewhere (Kohya's ``--logging_dir``; default ``log_dir``),
        ``samples_dir`` the image grids (default ``log_dir/samples``). A resumed run passes ``purge_step``
        (its first new step), so TensorBoard hides what the interrupted run logged from that step on
        instead of drawing two overlapping curves."""
        if report_to not in ("tensorboard", "none"):
            raise ValueError(f"report_to must be 'tensorboard' or 'none', got {report_to!r}")
        self.log_dir = Path(log_dir)
        self.tensorboard_dir = Path(tensorboard_dir) if tensorboard_dir is not None else self.log_dir
        self.samples_dir = Path(samples_dir) if samples_dir is not None else self.log_dir / "samples"
        self.is_main_process = is_main_process
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.metrics = MetricsTable()  # evaluation scores at validation points (validation loss, DINO, ...)
        self._writer = (_open_writer(self.tensorboard_dir, purge_step)
                        if report_to == "tensorboard" and is_main_process else None)
        self._text: TextIO | None = None

    @property
    def loss_history(self) -> list[tuple[int, float]]:
        """``(step, loss)`` pairs logged so far."""
        return self.history.get("loss", [])

    def log(self, step: int, scalars: Mapping[str, float], at: float | None = None) -> None:
        """Record scalars at ``step`` (e.g. loss, lr, grad_norm, loss_scale); ``at`` is when the step
        happened (``time.time()``; default now), for a step logged after the fact."""
        for name, value in scalars.items():
            value = float(value)
            self.history.setdefault(name, []).append((step, value))
            if self._writer is not None:
                self._writer.add_scalar(f"train/{name}", value, step, walltime=at)
        self.note(f"step {step} " + " ".join(f"{name}={float(value):.6g}" for name, value in scalars.items()),
                  at=at)

    def note(self, message: str, at: float | None = None) -> None:
        """Append a line stamped with the time ``at`` (default now) to ``train.log`` (main process only)."""
        if not self.is_main_process:
            return
        if self._text is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._text = open(self.log_dir / "train.log", "a", encoding="utf-8", buffering=1)  # line-buffered
        self._text.write(f"{log_time(at)} {message}\n")

    def log_metrics(self, step: int, scores: Mapping[str, float]) -> None:
        """Record evaluation scores at ``step`` (TensorBoard tag ``eval/<name>``; ``metrics.csv`` on close)."""
        self.metrics.add(step, scores)
        self.note(f"eval {step} " + " ".join(f"{name}={float(value):.6g}" for name, value in scores.items()))
        if self._writer is not None:
            for name, value in scores.items():
                self._writer.add_scalar(f"eval/{name}", float(value), step)

    def write_metrics(self, marks: Mapping[str, int] | None = None) -> dict[str, Path]:
        """``metrics.csv`` and ``metrics.png`` in ``log_dir`` (nothing without scores); their paths."""
        if not self.is_main_process or not self.metrics.rows:
            return {}
        return {"metrics table": self.metrics.write_csv(self.log_dir / "metrics.csv"),
                "metrics plot": draw_metrics(self.metrics, self.log_dir / "metrics.png", marks=marks)}

    def log_images(self, step: int, images: Sequence[Image.Image], tag: str = "validation") -> Path | None:
        """Save ``images`` as ``<samples_dir>/<tag>-<step>.png`` (and to TensorBoard), labelled with their
        prompts, seeds and the step; return the PNG path."""
        if not self.is_main_process or not images:
            return None
        path = save_image_grid(images, self.samples_dir / f"{tag}-{step:06d}.png", step=step)
        if self._writer is not None:
            grid = np.asarray(Image.open(path).convert("RGB"))  # (H, W, 3) uint8
            self._writer.add_image(tag, grid, step, dataformats="HWC")
        return path

    def close(self) -> Path | None:
        """Flush TensorBoard and draw ``loss_curve.png`` (with the validation loss when there is one);
        return its path (``None`` with no losses)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._text is not None:
            self._text.close()
            self._text = None
        if not self.is_main_process or not self.loss_history:
            return None
        steps, losses = zip(*self.loss_history)
        return draw_loss_curve(steps, losses, self.log_dir / "loss_curve.png",
                               validation=self.metrics.series("val_loss"))


def say(message: str, *, is_main_process: bool = True, file: TextIO | None = None) -> None:
    """Print a line once (from the main process) without breaking a progress bar's line."""
    if is_main_process:
        tqdm.write(message, file=file)


_BEFORE_THE_RUN: list[str] = []


def say_before_the_run(text: str) -> None:
    """Print ``text`` (e.g. the memory plan, made before the run starts) and keep it for the ``train.log`` of the
    run that starts next in this process (:func:`take_said_before_the_run`)."""
    tqdm.write(text)
    _BEFORE_THE_RUN.append(text)


def take_said_before_the_run() -> list[str]:
    taken = list(_BEFORE_THE_RUN)
    _BEFORE_THE_RUN.clear()
    return taken


def log_time(at: float | None = None) -> str:
    """The local time (now, or ``at`` from ``time.time()``) that starts every ``train.log`` line, to the
    millisecond (for seconds per step)."""
    moment = datetime.now() if at is None else datetime.fromtimestamp(at)
    return moment.isoformat(sep=" ", timespec="milliseconds")


def _open_writer(log_dir: Path, purge_step: int | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn("tensorboard is not installed, so no TensorBoard logs are written; "
                      "install it with 'pip install tensorboard' or set report_to to 'none'", stacklevel=3)
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def sample_parameters(image: Image.Image) -> list[dict[str, Any]]:
    """The generation parameters a sampler attached to ``image.info["dreamstep"]`` (a dict, or a list for
    an image that shows several samples), or ``[]``."""
    value = image.info.get(JSON_KEY)
    return [value] if isinstance(value, dict) else list(value) if isinstance(value, list) else []


# A composite sample (a control or input image beside its results) says where each result's cell is:
# ``info[LAYOUT_KEY]`` holds one (x, width) per entry of its parameters list, so each label goes under its result.
LAYOUT_KEY = "dreamstep_layout"
# Labels need room: a cell narrower than this (a 64 px sample) is widened with white space, never overlapped (the
# results inside a composite wrap to their own width instead).
LABEL_WIDTH = 150


def _wrapped(text: str, width: int, font: Any) -> list[str]:
    """``text`` in lines that each fit ``width`` pixels; a word too long for a line is cut with an ellipsis."""
    lines: list[str] = []
    for word in text.split() or [""]:
        if font.getlength(word) > width:  # ASCII dots: the bitmap font of older Pillow has no ellipsis character
            cut = word
            while len(cut) > 1 and font.getlength(cut + "...") > width:
                cut = cut[:-1]
            word = cut + "..."
        candidate = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(candidate) <= width:
            lines[-1] = candidate
        else:
            lines.append(word)
    return lines


def _label(cell: dict[str, Any], step: int | None, width: int, font: Any) -> list[str]:
    """Text under one sample: its prompt, then its seed and the training step, each fitted to ``width`` pixels."""
    tail = [f"seed {cell.get('seed')}"] + ([f"step {step}"] if step is not None else [])
    together = " | ".join(tail)
    return _wrapped(str(cell.get("prompt", "")), width, font) + (
        [together] if font.getlength(together) <= width else tail)


def _cell_labels(image: Image.Image, step: int | None, cell_w: int, font: Any) -> list[tuple[int, list[str]]]:
    """(x offset in the cell, lines) per labelled sample of ``image``: under each result of a composite, else all
    under the image."""
    cells = sample_parameters(image)
    layout = image.info.get(LAYOUT_KEY)
    if isinstance(layout, list) and len(layout) == len(cells):
        columns: dict[int, list[str]] = {}
        for cell, (x, width) in zip(cells, layout):
            columns.setdefault(x, []).extend(_label(cell, step, width - 4, font))
        return list(columns.items())
    return [(0, [line for cell in cells for line in _label(cell, step, cell_w - 4, font)])] if cells else []


def save_image_grid(images: Sequence[Image.Image], path: str | Path, columns: int | None = None,
                    step: int | None = None) -> Path:
    """Paste ``images`` row by row into one PNG (cells sized to the largest image); return ``path``. Images
    that carry their generation parameters (see :func:`sample_parameters`) are labelled with prompt, seed
    and ``step`` under the cell (under each result, for a composite that gives its :data:`LAYOUT_KEY`), and the
    PNG holds them in text chunks as ``dreamstep generate`` writes."""
    if not images:
        raise ValueError("save_image_grid needs at least one image")
    columns = columns or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    font = ImageFont.load_default()
    labelled = any(sample_parameters(im) for im in images)
    cell_w = max(im.width for im in images)
    if labelled:
        cell_w = max(cell_w, LABEL_WIDTH)
    labels = [_cell_labels(im, step, cell_w, font) for im in images]
    lines_per_cell = [max((len(lines) for _, lines in cell), default=0) for cell in labels]
    band = max(lines_per_cell) * _LINE_HEIGHT + 4 if labelled else 0
    cell_h = max(im.height for im in images) + band
    grid = Image.new("RGB", (columns * cell_w, rows * cell_h), "white")
    draw = ImageDraw.Draw(grid)
    for i, (im, cell) in enumerate(zip(images, labels)):
        x, y = (i % columns) * cell_w, (i // columns) * cell_h
        grid.paste(im.convert("RGB"), (x, y))
        for offset, lines in cell:
            for n, line in enumerate(lines):
                draw.text((x + offset + 2, y + cell_h - band + 2 + n * _LINE_HEIGHT), line, fill=_AXES, font=font)
    cells = [cell for im in images for cell in sample_parameters(im)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path, pnginfo=grid_png_info(step or 0, cells) if cells else None)
    return path


def smooth(values: Sequence[float], weight: float = 0.9) -> list[float]:
    """Debiased exponential moving average, as TensorBoard's smoothing slider computes it."""
    out, ema, norm = [], 0.0, 0.0
    for v in values:
        ema = weight * ema + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(ema / norm)
    return out


_LINE_HEIGHT = 12  # pixels per line of Pillow's default font
_SIZE = (800, 480)
_MARGIN = (70, 30, 30, 50)  # left, top, right, bottom: room for tick labels and the title
_RAW, _SMOOTH, _AXES, _VALIDATION = (170, 190, 230), (20, 70, 170), (60, 60, 60), (220, 100, 20)


def draw_loss_curve(steps: Sequence[int], losses: Sequence[float], path: str | Path,
                    smoothing: float = 0.9, validation: Sequence[tuple[int, float]] = ()) -> Path:
    """Draw the raw loss (light) and its smoothed curve (dark) against steps with labelled axes, and the
    validation loss (orange, with dots) when given; save PNG. Non-finite losses are left out of the plot.
    """
    points = [(int(s), float(v)) for s, v in zip(steps, losses) if math.isfinite(float(v))]
    image = Image.new("RGB", _SIZE, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    title = "training loss (light: raw, dark: smoothed)" + (", validation loss (orange)" if validation else "")
    draw.text((_MARGIN[0], 8), title, fill=_AXES, font=font)
    if points:
        xs, ys = zip(*points)
        all_x, all_y = xs + tuple(s for s, _ in validation), ys + tuple(v for _, v in validation)
        to_px = _projection(all_x, all_y)
        _draw_axes(draw, font, all_x, all_y, to_px)
        _polyline(draw, [to_px(x, y) for x, y in points], _RAW, 1)
        _polyline(draw, [to_px(x, y) for x, y in zip(xs, smooth(ys, smoothing))], _SMOOTH, 2)
        if validation:
            pixels = [to_px(x, y) for x, y in validation]
            _polyline(draw, pixels, _VALIDATION, 2)
            for x, y in pixels:
                draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=_VALIDATION)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def _projection(xs: Sequence[int], ys: Sequence[float]) -> Any:
    """Map (step, loss) to pixels in the plot area; flat ranges get a unit span so nothing divides by 0."""
    left, top, right, bottom = _MARGIN
    width, height = _SIZE[0] - left - right, _SIZE[1] - top - bottom
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def to_px(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * width, top + (1 - (y - y0) / (y1 - y0)) * height

    return to_px


def _draw_axes(draw: ImageDraw.ImageDraw, font: Any, xs: Sequence[int], ys: Sequence[float], to_px: Any) -> None:
    left, top, right, bottom = _MARGIN
    x_end, y_end = _SIZE[0] - right, _SIZE[1] - bottom
    draw.line([(left, top), (left, y_end), (x_end, y_end)], fill=_AXES, width=1)
    for x in _ticks(min(xs), max(xs), integer=True):
        px, _ = to_px(x, min(ys))
        draw.line([(px, y_end), (px, y_end + 4)], fill=_AXES)
        label = f"{int(x)}"
        draw.text((px - 3 * len(label), y_end + 8), label, fill=_AXES, font=font)  # roughly centred
    for y in _ticks(min(ys), max(ys), integer=False):
        _, py = to_px(min(xs), y)
        draw.line([(left - 4, py), (left, py)], fill=_AXES)
        draw.text((4, py - 6), f"{y:.4g}", fill=_AXES, font=font)
    draw.text((x_end - 30, y_end + 26), "step", fill=_AXES, font=font)


def _ticks(lo: float, hi: float, integer: bool, count: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    ticks = [lo + (hi - lo) * i / (count - 1) for i in range(count)]
    return sorted({round(t) for t in ticks}) if integer else ticks


def _polyline(draw: ImageDraw.ImageDraw, pixels: list[tuple[float, float]], color: tuple[int, int, int],
              width: int) -> None:
    if len(pixels) == 1:
        x, y = pixels[0]
        draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=color)
    else:
        draw.line(pixels, fill=color, width=width)
