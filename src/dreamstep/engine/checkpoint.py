"""Checkpoints that resume a run exactly, written atomically.

``checkpoint-<step>/`` holds::

    trainable_weights.safetensors   the tensors the caller passes (e.g. the LoRA state dict)
    optimizer.pt                    optimizer.state_dict() (sharded runs: the full state, by parameter name)
    lr_scheduler.pt                 lr_scheduler.state_dict() (when there is a scheduler)
    random_states.pt                per process: python, numpy, torch CPU (and CUDA) RNG, now and at the
                                    start of the current epoch
    trainer_state.json              position (epoch, batch in epoch, global step), TrainStep state, extra

Everything is written into a hidden temporary folder beside the final one and renamed into place, so a
crash mid-save leaves either the previous checkpoints or a complete new one, never a half-written
``checkpoint-<step>``. Under several processes only the main process writes; the RNG states of all
processes are gathered to it first.

RNG states are returned by :func:`load_checkpoint` but not applied: the training loop applies them at the
right moments (see ``dreamstep.engine.loop``), which is what makes shuffled data order and the random
numbers drawn in ``forward`` continue exactly as in an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dreamstep.engine.disk import DiskFullError, disk_full_message, free_bytes, is_disk_full, require_space
from dreamstep.engine.sharding import load_optimizer_state, optimizer_state
from dreamstep.engine.train_step import TrainStep
from dreamstep.errors import UserError, is_refused_pickle
from dreamstep.files import honour_umask, temporary_file_owner

__all__ = [
    "DamagedCheckpointError",
    "LoadedCheckpoint",
    "TrainingPosition",
    "broadcast_from_main",
    "capture_rng_state",
    "check_weights_file",
    "checkpoint_bytes",
    "list_checkpoints",
    "load_checkpoint",
    "read_checkpoint_extra",
    "read_checkpoint_step",
    "prune_checkpoints",
    "remove_leftovers",
    "resolve_resume",
    "resume_candidates",
    "restore_rng_state",
    "save_checkpoint",
]

WEIGHTS_FILE = "trainable_weights.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "lr_scheduler.pt"
RNG_FILE = "random_states.pt"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_NAME = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.checkpoint-\d+\.(?:tmp|old|deleting)-(\d+)$")


@dataclass
class TrainingPosition:
    """Where a run stands after an optimizer step.

    ``batch_in_epoch`` batches of epoch ``epoch`` have been consumed. ``epoch_start_rng`` is this process's
    RNG state taken just before the epoch's data iterator was created; restoring it recreates the same
    shuffled order even for a loader that draws its permutation from the global RNG.
    """

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    epoch_start_rng: dict[str, Any] | None = field(default=None, repr=False, compare=False)


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` hands back; optimizer, scheduler and TrainStep are already restored."""

    path: Path
    weights: dict[str, torch.Tensor]  # on CPU; the caller loads them into its model
    position: TrainingPosition
    rng_state: dict[str, Any] | None  # this process's RNG at save time; applied by the loop
    extra: dict[str, Any]


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states, as tensors and plain types (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    random.setstate(_as_tuples(state["python"]))
    np_state = state["numpy"]
    keys = np_state["keys"].numpy().astype(np.uint32)
    np.random.set_state((np_state["kind"], keys, np_state["pos"], np_state["has_gauss"],
                         np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` needs tuples; a round trip through some serialisers returns lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-<step>`` folders in ``output_dir``, oldest (smallest step) first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def save_checkpoint(output_dir: str | Path, train_step: TrainStep, position: TrainingPosition,
                    weights: Mapping[str, torch.Tensor], *, extra: Mapping[str, Any] | None = None,
                    total_limit: int | None = None) -> Path:
    """Write ``output_dir/checkpoint-<global_step>`` atomically and prune to ``total_limit`` checkpoints.

    Call it on every process (RNG states, and sharded optimizer state, are gathered collectively); only the
    main process writes.
    ``weights`` are the trainable tensors (e.g. ``get_peft_model_state_dict(model)``); ``extra`` is any
    JSON-able dict (e.g. the resolved config). Returns the checkpoint's path. When the disk cannot take
    the checkpoint (checked before writing, or found while writing) every process raises
    :class:`~dreamstep.engine.disk.DiskFullError` and the earlier checkpoints stay as they were.
    """
    accelerator = train_step.accelerator
    rng = _gather({"current": capture_rng_state(), "epoch_start": position.epoch_start_rng}, accelerator)
    optimizer = optimizer_state(train_step.model, train_step.optimizer)
    final = Path(output_dir) / f"checkpoint-{position.global_step}"
    disk_full = None
    if _is_main(accelerator):
        try:
            _write_checkpoint(final, train_step, position, weights, optimizer, extra, rng)
        except DiskFullError as e:
            disk_full = str(e)
        if disk_full is None and total_limit is not None:
            prune_checkpoints(final.parent, total_limit)
    disk_full = broadcast_from_main(disk_full, accelerator)  # also the barrier: every process waits for the save
    if disk_full is not None:
        raise DiskFullError(disk_full)
    return final


def checkpoint_bytes(optimizer: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
                     extra: Mapping[str, Any] | None = None, processes: int = 1) -> int:
    """At least what a checkpoint takes on disk: the weights, the tensors of the optimizer's state dict, the
    JSON ``extra`` (loss history, config), and an allowance per process for its RNG states and the files'
    headers and pickled structure (a few KB; 64 KiB allowed)."""
    tensors = list(weights.values())
    for state in optimizer.get("state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return tensor_bytes + len(json.dumps(extra or {}, default=str)) + processes * 64 * 2**10


def _write_checkpoint(final: Path, train_step: TrainStep, position: TrainingPosition,
                      weights: Mapping[str, torch.Tensor], optimizer: dict[str, Any],
                      extra: Mapping[str, Any] | None, rng: list[dict[str, Any]]) -> None:
    """Check the free space, write into a hidden folder, rename it into place."""
    earlier = list_checkpoints(final.parent)
    needed = max([checkpoint_bytes(optimizer, weights, extra, len(rng))] + [_tree_bytes(p) for p in earlier[-1:]])
    keeps = (f"the last good checkpoint, {earlier[-1]}, is kept" if earlier else "no checkpoint was written yet")
    require_space(final.parent, needed, final.name, keeps)
    remove_leftovers(final.parent)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        _write_contents(tmp, train_step, position, weights, optimizer, extra, rng)
    except BaseException as e:  # a second Ctrl-C too: no half-written folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and (is_disk_full(e) or free_bytes(final.parent) < needed):
            raise DiskFullError(disk_full_message(final.parent, needed, final.name, keeps)) from None
        raise
    _replace_dir(tmp, final)


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def remove_leftovers(output_dir: str | Path) -> list[str]:
    """Delete hidden folders left by a save or prune of this process, or of a process that has died, and the
    temporary files of an atomic write (``.run_status.json.PID.tmp``) of such a process (never a visible
    checkpoint, never what a live run is writing); return their names."""
    removed = []
    for path in sorted(Path(output_dir).glob(".checkpoint-*")):
        match = _LEFTOVER.match(path.name)
        if match and _gone_or_self(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    for path in sorted(Path(output_dir).glob(".*.tmp")):
        owner = temporary_file_owner(path)
        if owner is not None and _gone_or_self(owner):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _gone_or_self(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.name == "nt":  # os.kill would end the process there
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False


def _write_contents(folder: Path, train_step: TrainStep, position: TrainingPosition,
                    weights: Mapping[str, torch.Tensor], optimizer: dict[str, Any],
                    extra: Mapping[str, Any] | None, rng: list[dict[str, Any]]) -> None:
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    honour_umask(folder / WEIGHTS_FILE)
    torch.save(optimizer, folder / OPTIMIZER_FILE)
    if train_step.lr_scheduler is not None:
        torch.save(train_step.lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
    torch.save(rng, folder / RNG_FILE)
    state = {"format_version": FORMAT_VERSION, "global_step": position.global_step, "epoch": position.epoch,
             "batch_in_epoch": position.batch_in_epoch, "num_processes": len(rng),
             "train_step": train_step.state_dict(), "extra": dict(extra or {})}
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2))
    _fsync_tree(folder)


def _fsync_tree(folder: Path) -> None:
    """Flush file contents to disk before the rename makes the checkpoint visible."""
    for path in folder.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (the same step saved again) is moved aside first."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)


def prune_checkpoints(output_dir: str | Path, total_limit: int) -> list[Path]:
    """Delete all but the newest ``total_limit`` checkpoints; return the deleted paths.

    Each is renamed to a hidden name before deletion so a crash never leaves a partial ``checkpoint-<step>``.
    """
    if total_limit < 1:
        raise ValueError(f"checkpoints_total_limit must be >= 1, got {total_limit}")
    removed = list_checkpoints(output_dir)[:-total_limit]
    for path in removed:
        doomed = path.parent / f".{path.name}.deleting-{os.getpid()}"
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    return removed


def resolve_resume(output_dir: str | Path, resume_from_checkpoint: str | Path | None,
                   flag: str = "--resume_from_checkpoint") -> Path | None:
    """Turn ``--resume_from_checkpoint`` (or the recipe's ``flag``) into a checkpoint folder.

    ``None``/``""``: start fresh. ``latest``: the newest ``checkpoint-<step>`` in ``output_dir``, or ``None``
    when there is none yet (a first run with ``latest`` starts fresh). A path, or a folder name inside
    ``output_dir``: that checkpoint; a missing one is a :class:`UserError`.
    """
    if resume_from_checkpoint in (None, ""):
        return None
    if str(resume_from_checkpoint) == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    for candidate in (Path(resume_from_checkpoint), Path(output_dir) / str(resume_from_checkpoint)):
        if candidate.is_dir():
            return candidate
    available = ", ".join(p.name for p in list_checkpoints(output_dir)) or "none"
    raise UserError(f"{flag}: '{resume_from_checkpoint}' not found (checkpoints in "
                    f"{output_dir}: {available}); give a checkpoint folder or 'latest'")


class DamagedCheckpointError(UserError):
    """A file of the checkpoint is missing, truncated or unreadable; the message names it."""


def resume_candidates(output_dir: str | Path, resume_from_checkpoint: str | Path | None,
                      flag: str = "--resume_from_checkpoint") -> tuple[Path | None, list[str]]:
    """The checkpoint a resume will load, checked to be readable before the run writes anything, and one
    warning per checkpoint passed over. ``latest`` gives way to the newest checkpoint that reads, and is a
    :class:`UserError` when none does; a checkpoint named by the user must read (its error names the file)."""
    chosen = resolve_resume(output_dir, resume_from_checkpoint, flag)
    if chosen is None:
        return None, []
    if str(resume_from_checkpoint) != "latest":
        check_readable(chosen)
        return chosen, []
    warnings, damaged = [], []
    for path in reversed(list_checkpoints(output_dir)):
        try:
            check_readable(path)
        except DamagedCheckpointError as e:
            warnings.append(f"warning: {e}")
            damaged.append(path.name)
            continue
        if damaged:
            warnings.append(f"warning: {', '.join(damaged)} cannot be read; resuming from {path.name}, the newest "
                            "checkpoint that loads")
        return path, warnings
    raise UserError(f"{flag} latest: no checkpoint in {output_dir} can be read ({'; '.join(warnings)}); "
                    "nothing was changed; start a new run in a new --output_dir")


def check_readable(path: Path) -> None:
    """Read every file of checkpoint ``path`` as :func:`load_checkpoint` will (tensors memory-mapped, not
    copied), so a damaged or refused one is found before anything is written; restore nothing."""
    _read(path, STATE_FILE, _read_state)
    check_weights_file(path)
    for name in (OPTIMIZER_FILE, RNG_FILE) + ((SCHEDULER_FILE,) if (path / SCHEDULER_FILE).exists() else ()):
        _read(path, name, _torch_peek)


def _torch_peek(file: Path) -> Any:
    """:func:`_torch_load` without copying the tensors of a ``torch.save`` zip archive (memory-mapped)."""
    with open(file, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"
    return torch.load(file, map_location="cpu", weights_only=True, mmap=is_zip)


def check_weights_file(checkpoint: Path) -> None:
    """Raise :class:`DamagedCheckpointError` naming the checkpoint's weights file unless it is a readable
    safetensors file (read without loading its tensors)."""
    _read(checkpoint, WEIGHTS_FILE, _safetensors_header)


def _safetensors_header(file: Path) -> list[str]:
    with open(file, "rb") as f:
        head = f.read(9)  # safetensors: an 8-byte header length (any first byte), then the JSON header's "{"
    if head[8:9] != b"{" and (head[:1] == b"\x80" or head[:4] == b"PK\x03\x04"):
        raise DamagedCheckpointError(f"{file}: a torch pickle, not the safetensors file a checkpoint holds; it was "
                                     "not loaded (nothing in it ran)")
    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def load_checkpoint(path: str | Path, train_step: TrainStep) -> LoadedCheckpoint:
    """Restore optimizer, LR scheduler and TrainStep state from ``path``; return weights, position, RNG, extra.

    Every file is read before anything is restored, so a damaged checkpoint
    (:class:`DamagedCheckpointError`, naming the file) leaves the TrainStep untouched. The caller copies
    ``weights`` into its model; the loop applies the RNG states (pass the result to ``run_training(resume=...)``).
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: checkpoint folder not found; check the resume flag")
    state = _read(path, STATE_FILE, _read_state)
    weights = _read(path, WEIGHTS_FILE, lambda file: load_file(str(file), device="cpu"))
    optimizer = _read(path, OPTIMIZER_FILE, _torch_load)
    scheduler_state = _read(path, SCHEDULER_FILE, _torch_load) if train_step.lr_scheduler is not None else None
    rng = _this_process_rng(_read(path, RNG_FILE, _torch_load), train_step.accelerator)
    load_optimizer_state(train_step.model, train_step.optimizer, optimizer)
    if scheduler_state is not None:
        train_step.lr_scheduler.load_state_dict(scheduler_state)
    try:
        train_step.load_state_dict(state["train_step"])
    except (KeyError, ValueError) as e:
        raise UserError(f"{path / STATE_FILE}: TrainStep state does not match this run ({e}); resume with the "
                        "same loss scaler settings") from None
    position = TrainingPosition(global_step=state["global_step"], epoch=state["epoch"],
                                batch_in_epoch=state["batch_in_epoch"],
                                epoch_start_rng=rng["epoch_start"] if rng else None)
    return LoadedCheckpoint(path=path, weights=weights, position=position,
                            rng_state=rng["current"] if rng else None, extra=state["extra"])


def read_checkpoint_extra(path: str | Path) -> dict[str, Any]:
    """The ``extra`` a checkpoint was saved with, read without loading any tensor."""
    return _read(Path(path), STATE_FILE, _read_state).get("extra", {})


def read_checkpoint_step(path: str | Path) -> int:
    """The optimizer step a checkpoint was saved at, read without loading any tensor."""
    return int(_read(Path(path), STATE_FILE, _read_state)["global_step"])


def _read(path: Path, name: str, reader: Callable[[Path], Any]) -> Any:
    """``reader(path / name)``; any failure to read becomes a :class:`DamagedCheckpointError` naming the file."""
    file = path / name
    if not file.is_file():
        raise DamagedCheckpointError(f"{file}: missing from the checkpoint; it is incomplete, resume from another one")
    try:
        return reader(file)
    except UserError:
        raise
    except Exception as e:
        if is_refused_pickle(e):
            raise DamagedCheckpointError(f"{file}: a pickle holding objects other than tensors, which may run code, "
                                         "so it was not loaded (nothing in it ran); resume from another "
                                         "checkpoint") from None
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise DamagedCheckpointError(f"{file}: unreadable, the file is damaged or truncated ({reason}); "
                                     "resume from another checkpoint") from None


def _read_state(file: Path) -> dict[str, Any]:
    state = json.loads(file.read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{file}: checkpoint format {state.get('format_version')} is not supported "
                        f"(expected {FORMAT_VERSION})")
    return state


def _torch_load(file: Path) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True)


def _this_process_rng(per_process: list[dict[str, Any]], accelerator: Any) -> dict[str, Any] | None:
    """This rank's saved RNG; ``None`` (keep the seeded RNG) when the run now has more processes."""
    rank = accelerator.process_index if accelerator is not None else 0
    return per_process[rank] if rank < len(per_process) else None


def _is_main(accelerator: Any) -> bool:
    return accelerator is None or accelerator.is_main_process


def broadcast_from_main(value: Any, accelerator: Any) -> Any:
    """The main process's ``value`` on every process; a barrier too."""
    if accelerator is None or accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def _gather(obj: dict[str, Any], accelerator: Any) -> list[dict[str, Any]]:
    """Collect one object per process, in rank order, on every process."""
    if accelerator is None or accelerator.num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])
