"""Run folders as the dashboard shows them: found under the folders the user gave, each read on demand
and cached by file size and modification time, so a refresh costs only what changed.

A run folder is one that holds any of ``config.toml``, ``train.log``, ``run_status.json`` or TensorBoard
event files. Every section of a run is read on its own: a corrupt ``config.toml`` or a half-written
sample shows an error in that section, and the rest of the run, and every other run, still shows.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dreamstep.config.schema import load_toml
from dreamstep.dashboard.heavy import import_heavy
from dreamstep.dashboard.run_base import run_base
from dreamstep.dashboard.scalars import TEXT_LOG, RunScalars, decimate, find_event_files
from dreamstep.errors import UserError

__all__ = ["Run", "RunIndex", "discover_runs"]

MARKERS = ("config.toml", TEXT_LOG, "run_status.json")
SAMPLE_DIRS = ("samples", "sample")
SAMPLE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
LORA_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth")
STATUS_FILE = "run_status.json"
RUN_STATES = ("running", "finished", "failed", "interrupted")
LOCK_FILES = (".dreamstep.lock", "dreamstep.lock", ".lock")
STALE_AFTER_S = 300  # no new step for this long, and no live process: the run is not running
MAX_POINTS = 2000
LATEST_SAMPLES = 48  # sent with every refresh; the page asks for the rest (thousands, for long runs) once
_STEP_IN_NAME = re.compile(r"(?:^|[-_])(\d{4,})(?=[-_.])")
_FINISHED = " finished; wrote:"
_TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def is_run_folder(folder: Path) -> bool:
    return any((folder / m).is_file() for m in MARKERS) or bool(list(folder.glob("events.out.tfevents.*")))


def discover_runs(roots: list[Path]) -> dict[str, Path]:
    """Run id -> folder: each root that is a run is ``"<i>"``; each run folder directly inside root i is
    ``"<i>.<name>"``. Ids are looked up, never joined into paths."""
    found: dict[str, Path] = {}
    for i, root in enumerate(roots):
        if is_run_folder(root):
            found[str(i)] = root
        if root.is_dir():
            for child in sorted(root.iterdir(), key=lambda p: p.name):
                if child.is_dir() and not child.name.startswith(".") and is_run_folder(child):
                    found[f"{i}.{child.name}"] = child
    return found


class _Cached:
    """Values computed from one file, recomputed when its size or modification time changes."""

    def __init__(self) -> None:
        self._values: dict[tuple[Path, str], tuple[tuple[int, int], Any]] = {}
        self._lock = threading.Lock()

    def get(self, path: Path, kind: str, compute: Callable[[Path], Any]) -> Any:
        stat = path.stat()
        key, stamp = (path, kind), (stat.st_size, stat.st_mtime_ns)
        with self._lock:
            hit = self._values.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = compute(path)
        with self._lock:
            self._values[key] = (stamp, value)
        return value


def read_section(compute: Callable[[], Any]) -> Any:
    """Run one section's reader; a failure becomes ``{"error": ...}`` for that section only."""
    try:
        return compute()
    except Exception as e:  # noqa: BLE001 - any unreadable file must not take the page down
        return {"error": f"{type(e).__name__}: {e}" if not isinstance(e, UserError) else str(e)}


class Run:
    """One run folder."""

    def __init__(self, run_id: str, folder: Path, cache: _Cached):
        self.id, self.folder, self._cache = run_id, folder, cache
        self.scalars = RunScalars(folder)

    @property
    def name(self) -> str:
        return self.folder.name

    def config(self) -> dict[str, Any]:
        path = self.folder / "config.toml"
        if not path.is_file():
            return {}
        return self._cache.get(path, "toml", lambda p: load_toml(p))

    def config_text(self) -> str | None:
        path = self.folder / "config.toml"
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None

    def status_file(self) -> dict[str, Any]:
        path = self.folder / STATUS_FILE
        if not path.is_file():
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{STATUS_FILE} is not a JSON object")
        return data

    def summary(self) -> dict[str, Any]:
        """Status, step / total, seconds per step, ETA and last loss; errors are reported per field."""
        out: dict[str, Any] = {"id": self.id, "name": self.name, "folder": str(self.folder), "errors": []}
        series = read_section(self.scalars.refresh)
        if "error" in series:
            out["errors"].append(f"scalars: {series['error']}")
            series = {}
        status = read_section(self.status_file)
        if "error" in status:
            out["errors"].append(f"{STATUS_FILE}: {status['error']}")
            status = {}
        config = read_section(self.config)
        if "error" in config:
            out["errors"].append(f"config.toml: {config['error']}")
            config = {}
        status = _checked(status, STATUS_FIELDS, self.folder / STATUS_FILE, out["errors"])
        config = _checked(config, CONFIG_FIELDS, self.folder / "config.toml", out["errors"])
        loss = series.get("loss")
        step = status.get("step", loss.steps[-1] if loss and loss.steps else None)
        total = status.get("total") or config.get("max_train_steps")
        per_step = loss.seconds_per_step() if loss else None
        state, detail = self._state(status, loss)
        out.update(state=state, state_detail=detail, step=step, total=total, seconds_per_step=per_step,
                   last_loss=loss.values[-1] if loss and loss.values else None,
                   eta_s=(total - step) * per_step if state == "running" and per_step and total and step is not None
                   else None, updated=self._last_change())
        return out

    def _state(self, status: dict[str, Any], loss: Any) -> tuple[str, str]:
        """From ``run_status.json`` when the trainer wrote one, else from the files: the end-of-run line
        in train.log (finished), a live process holding the folder's lock or a recent step (running)."""
        pid = _valid_pid(status.get("pid")) or self._lock_pid()
        alive = pid is not None and _pid_alive(pid)
        if status.get("state"):
            state = str(status["state"])
            if state == "running" and pid is not None and not alive:
                return "interrupted", f"{STATUS_FILE} says running, but process {pid} is gone"
            return state, f"from {STATUS_FILE}"
        if self._log_says_finished():
            return "finished", "train.log ends with the run's summary"
        if alive:
            return "running", f"process {pid} holds the folder"
        age = time.time() - self._last_change()
        if age < STALE_AFTER_S:
            return "running", f"last step {age:.0f} s ago"
        if (self.folder / "loss_curve.png").is_file() and any(self.loras_paths()):
            return "finished", "final LoRA and loss curve present"
        return "interrupted", f"no step for {age / 60:.0f} min and no live process (no {STATUS_FILE})"

    def _lock_pid(self) -> int | None:
        for name in LOCK_FILES:
            path = self.folder / name
            if path.is_file():
                match = re.search(r"\d{1,7}", path.read_text(errors="replace")[:200])
                if match:
                    return _valid_pid(int(match.group(0)))
        return None

    def _log_says_finished(self) -> bool:
        """The last timestamped line of train.log is the end-of-run summary (the lines after it, the
        written files and evaluation report, carry no timestamp)."""
        path = self.folder / TEXT_LOG
        if not path.is_file():
            return False
        for line in reversed(read_tail(path, 16384).splitlines()):
            if _TIMESTAMPED.match(line):
                return _FINISHED in line
        return False

    def _last_change(self) -> float:
        candidates = [self.folder / TEXT_LOG, self.folder / STATUS_FILE, *find_event_files(self.folder, depth=1)]
        times = [p.stat().st_mtime for p in candidates if p.is_file()]
        return max(times, default=self.folder.stat().st_mtime)

    def curves(self, max_points: int = MAX_POINTS) -> dict[str, Any]:
        """Loss (raw and smoothed) and every other scalar, decimated for drawing."""
        series = self.scalars.refresh()
        out: dict[str, Any] = {"source": self.scalars.source}
        for tag, s in series.items():
            steps, values = decimate(s.steps, s.values, max_points)
            entry: dict[str, Any] = {"steps": steps, "values": values, "count": len(s.steps)}
            if tag == "loss":
                entry["smoothed_steps"], entry["smoothed"] = decimate(s.steps, s.smoothed, max_points // 2)
            out[tag] = entry
        return out

    def samples(self) -> list[dict[str, Any]]:
        """Every sample image, oldest step first, labelled with prompt, step and seed (from the image's
        own text chunks when it has them, else from the file name and config.toml)."""
        config = read_section(self.config)
        defaults = {} if "error" in config else config
        found = []
        for folder in SAMPLE_DIRS:
            base = self.folder / folder
            if base.is_dir():
                found += [p for p in base.iterdir() if p.suffix.lower() in SAMPLE_SUFFIXES and p.is_file()]
        items = [self._cache.get(p, "sample", lambda q: _sample_label(q, self.folder)) for p in found]
        for item in items:
            item.setdefault("prompt", _default_prompt(defaults))
            item.setdefault("seed", defaults.get("seed"))
        return sorted(items, key=lambda i: (i.get("step") if i.get("step") is not None else -1, i["path"]))

    def loras_paths(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if p.suffix.lower() in LORA_SUFFIXES and p.is_file())

    def loras(self) -> list[dict[str, Any]]:
        """The output weight files with the ``lora info`` report of each, checked against the run's own base
        (:func:`~dreamstep.dashboard.run_base.run_base`)."""
        config = read_section(self.config)
        base = run_base(config, self.folder) if "error" not in config else None
        out = []
        model = _diffusers_model_class(self.folder)
        for path in self.loras_paths():
            if model is not None and path.name.startswith("diffusion_pytorch_model"):
                out.append({"name": path.name, "size": path.stat().st_size,
                            "info": f"{model} weights (diffusers save_pretrained layout, not a LoRA file): load "
                                    f"the run folder with {model}.from_pretrained"})
                continue
            info = read_section(lambda: self._cache.get(path, f"lora:{base}", lambda p: _lora_info(p, base)))
            out.append({"name": path.name, "size": path.stat().st_size,
                        **({"info": info} if isinstance(info, str) else info)})
        return out

    def metrics(self) -> dict[str, Any] | None:
        """Evaluation scores: ``metrics.csv`` (a ``step`` column, then one column per metric) when the run
        wrote it (at its end), else the scores logged so far in train.log; and whether ``metrics.png`` exists."""
        path = self.folder / "metrics.csv"
        if path.is_file():
            return {**self._cache.get(path, "csv", _read_metrics), "png": (self.folder / "metrics.png").is_file(),
                    "source": "metrics.csv"}
        self.scalars.refresh()
        rows = self.scalars.evaluation
        if not rows:
            return None
        names = sorted({name for scores in rows.values() for name in scores})
        steps = sorted(rows)
        return {"steps": steps, "metrics": {n: [rows[s].get(n) for s in steps] for n in names}, "png": False,
                "source": TEXT_LOG}

    def log_tail(self, lines: int = 200) -> list[str] | None:
        path = self.folder / TEXT_LOG
        if not path.is_file():
            return None
        return read_tail(path, 256 * 1024).splitlines()[-lines:]

    def lora_files(self) -> list[dict[str, Any]]:
        """Name, size and modification time of each output weight file (the page asks for the reports
        of :meth:`loras` only when these change: the first report imports torch, which takes seconds)."""
        return [{"name": p.name, "size": p.stat().st_size, "mtime": p.stat().st_mtime} for p in self.loras_paths()]

    def detail(self) -> dict[str, Any]:
        """Everything the run page shows but the LoRA reports; each section fails on its own."""
        samples = read_section(self.samples)
        if isinstance(samples, list):
            samples, total = samples[-LATEST_SAMPLES:], len(samples)
        else:
            total = 0
        return {"summary": self.summary(), "curves": read_section(self.curves), "samples": samples,
                "samples_total": total,
                "metrics": read_section(self.metrics), "config": read_section(self.config_text),
                "lora_files": read_section(self.lora_files), "log": read_section(self.log_tail)}


class RunIndex:
    """The runs under the given folders, rediscovered on each listing; a run keeps its cached state."""

    def __init__(self, roots: list[Path]):
        self.roots = roots
        self._runs: dict[str, Run] = {}
        self._cache = _Cached()

    def runs(self) -> dict[str, Run]:
        found = discover_runs(self.roots)
        for run_id, folder in found.items():
            if run_id not in self._runs or self._runs[run_id].folder != folder:
                self._runs[run_id] = Run(run_id, folder, self._cache)
        self._runs = {k: v for k, v in self._runs.items() if k in found}
        return self._runs

    def get(self, run_id: str) -> Run | None:
        return self.runs().get(run_id)


def read_tail(path: Path, size: int) -> str:
    """The last ``size`` bytes of a file as text, starting at a line boundary."""
    with open(path, "rb") as f:
        end = f.seek(0, 2)
        f.seek(max(0, end - size))
        data = f.read()
    if end > size:
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", errors="replace")


def _whole(least: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= least


# What the summary reads from each file, and what a value must be: a damaged file (edited by hand, cut short by a
# full disk) is named with its key, not shown as if the trainer had written it.
STATUS_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "state": (lambda v: v in RUN_STATES, f"one of {', '.join(RUN_STATES)}"),
    "step": (_whole(0), "a whole number from 0"), "total": (_whole(1), "a whole number from 1")}
CONFIG_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {"max_train_steps": (_whole(1), "a whole number from 1")}


def _checked(values: dict[str, Any], fields: dict[str, tuple[Callable[[Any], bool], str]], path: Path,
             errors: list[str]) -> dict[str, Any]:
    """``values`` without the ones ``fields`` refuses; each refused one is an error line naming file and key."""
    kept = dict(values)
    for key, (valid, expected) in fields.items():
        if key in kept and not valid(kept[key]):
            errors.append(f"{path}: '{key}' is {json.dumps(kept.pop(key), default=str)[:60]}, not {expected}; "
                          "the dashboard ignores it (the trainer never writes such a value: was the file edited?)")
    return kept


def _valid_pid(value: Any) -> int | None:
    """A process id from a file anyone may have written: a positive int within the kernel's range, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**22 else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _default_prompt(config: dict[str, Any]) -> str | None:
    """The run's validation prompt(s) from its config: one text, or a list (a ControlNet's, one per image)."""
    prompt = config.get("validation_prompt")
    if isinstance(prompt, list) and prompt:
        return " | ".join(str(p) for p in prompt)
    return prompt if isinstance(prompt, str) else None


def _sample_label(path: Path, run_folder: Path) -> dict[str, Any]:
    """The step from the file name; prompt, seed and step from the PNG's ``dreamstep`` text chunk, if any (a grid's
    chunk lists its cells' prompts and seeds: ``images``, as the trainers' sample grids write it)."""
    item: dict[str, Any] = {"path": path.relative_to(run_folder).as_posix(), "name": path.name}
    match = _STEP_IN_NAME.search(path.stem + ".")
    if match:
        item["step"] = int(match.group(1))
        item["kind"] = path.stem[:match.start()] or None  # "validation", "final", an sd-scripts output name
    from PIL import Image

    try:
        with Image.open(path) as image:
            item["size"] = list(image.size)
            text = dict(getattr(image, "text", {}) or {})
    except Exception as e:  # noqa: BLE001 - a half-written image gets a note, not an error page
        item["error"] = f"unreadable image ({type(e).__name__})"
        return item
    try:
        params = json.loads(text.get("dreamstep", "{}"))
    except json.JSONDecodeError:
        params = {}
    if isinstance(params, dict):
        for key in ("prompt", "seed", "step"):
            if params.get(key) is not None:
                item[key] = params[key]
        cells = [c for c in params.get("images", ()) if isinstance(c, dict)] if isinstance(
            params.get("images"), list) else []  # a grid of samples: each cell's parameters
        prompts = params.get("prompts") if isinstance(params.get("prompts"), list) else [c.get("prompt") for c in cells]
        seeds = params.get("seeds") if isinstance(params.get("seeds"), list) else [c.get("seed") for c in cells]
        if prompts:
            item["prompt"] = " | ".join(str(p) for p in prompts)
        if seeds:
            item["seed"] = seeds[0] if len(seeds) == 1 else ", ".join(str(s) for s in seeds)
    return item


def _diffusers_model_class(folder: Path) -> str | None:
    """The ``_class_name`` of a diffusers model saved in ``folder`` (a ControlNet run's output), or None."""
    try:
        name = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _lora_info(path: Path, base: str | None) -> str:
    return import_heavy("dreamstep.lora.info").describe(str(path), base=base)


def _read_metrics(path: Path) -> dict[str, Any]:
    rows = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8", errors="replace"))))
    if not rows or not rows[0] or rows[0][0].strip() != "step":
        raise ValueError("metrics.csv must start with a 'step' column")
    header = [h.strip() for h in rows[0]]
    columns: dict[str, list[float | None]] = {h: [] for h in header}
    for row in rows[1:]:
        if len(row) != len(header):
            continue  # a half-written last line
        for name, text in zip(header, row):
            try:
                columns[name].append(float(text))
            except ValueError:
                columns[name].append(None)
    return {"steps": columns.pop("step"), "metrics": columns}
