"""A quantized base kept on disk, so that only the first start of a run quantizes it: quantizing FLUX.1's 12B
transformer on the CPU takes minutes (nf4 about 13 on two cores, int8/fp8 about 4) and every resume paid it again.

The base is written with diffusers' own ``save_pretrained`` (safetensors, never pickle; torchao's weights through
its safetensors support, bitsandbytes' 4-bit weights with their quantization state) and read back with
``from_pretrained``, which rebuilds the quantized layers from the ``quantization_config`` it saved. The key is the
source's identity (each weight file's path, size and modification time; a hub model's snapshot), the mode, the
dtype and the versions of diffusers, torchao and bitsandbytes. ``DREAMSTEP_QUANTIZED_CACHE`` names the folder
(default ``$XDG_CACHE_HOME/dreamstep/quantized``), or ``none`` to keep nothing. A damaged or unreadable entry is
quantized afresh and replaced; a full disk only means quantizing again next time."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dreamstep.engine.logging import say
from dreamstep.models.memory_plan import stored_bytes

CACHE_ENV = "DREAMSTEP_QUANTIZED_CACHE"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json")


def cache_root() -> Path | None:
    """The cache folder, or ``None`` when the user keeps none."""
    chosen = os.environ.get(CACHE_ENV, "")
    if chosen.lower() in ("none", "off", "0"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dreamstep" / "quantized"


def files_identity(*files: Path) -> str:
    """The identity of weight files: each one's path, size and modification time (a replaced file misses)."""
    return "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def source_identity(source: str, subfolder: str, revision: str | None, variant: str | None) -> str | None:
    """The identity of a model folder's or hub model's ``subfolder``: its weight files (a hub model's in its local
    snapshot); ``None`` for a hub model not in the local cache yet (the first start downloads it, a later one keeps
    the quantized base)."""
    folder = Path(source).expanduser() / subfolder
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(source, revision=revision, allow_patterns=[f"{subfolder}/*"],
                                            local_files_only=True)) / subfolder
        except Exception:  # not in the local cache: nothing to key on, so nothing is kept
            return None
        if not folder.is_dir():
            return None
    files = sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    return f"{variant}|{files_identity(*files)}"


def _versions() -> str:
    found = []
    for package in ("diffusers", "torchao", "bitsandbytes"):
        try:
            found.append(f"{package}={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package}=none")
    return ",".join(found)


def load_or_quantize(model_class: type, identity: str | None, mode: str, dtype: torch.dtype,
                     load_kwargs: dict[str, Any], quantize: Callable[[], nn.Module], what: str) -> nn.Module:
    """The base that ``quantize()`` loads and quantizes as ``mode``, read from the cache when an earlier start kept
    it for the same ``identity`` (``None``: no identity, no caching); ``load_kwargs``: ``from_pretrained``'s dtype
    and device arguments for the cached copy, as for the source."""
    root = cache_root()
    if mode == "none" or identity is None or root is None:
        return quantize()
    key = hashlib.sha256(f"{identity}|{mode}|{dtype}|{model_class.__name__}|{_versions()}".encode()).hexdigest()
    folder = root / f"{re.sub(r'[^a-z0-9]+', '-', what.lower())}-{mode}-{key[:20]}"
    if (folder / "config.json").is_file():
        try:
            model = model_class.from_pretrained(str(folder), **load_kwargs)
        except Exception as error:  # damaged, half-deleted or written by an incompatible library: quantize again
            say(f"the {mode} {what} kept in {folder} did not load ({type(error).__name__}); quantizing it again")
            shutil.rmtree(folder, ignore_errors=True)
        else:
            say(f"loaded the {mode} {what} quantized at an earlier start from {folder}")
            return model
    model = quantize()
    _keep(model, folder, mode, what)
    return model


def _keep(model: nn.Module, folder: Path, mode: str, what: str) -> None:
    size = sum(stored_bytes(t) for t in [*model.parameters(), *model.buffers()])
    partial = folder.with_name(f".{folder.name}.{os.getpid()}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(folder.parent).free < size * 1.1:
            say(f"not keeping the {mode} {what} for the next start: {folder.parent} has less than "
                f"{size / 2**30:.1f} GiB free (set {CACHE_ENV} to another folder)")
            return
        model.save_pretrained(str(partial), safe_serialization=True)
        partial.rename(folder)
    except OSError as error:  # a full or read-only disk, or another process that kept it first
        shutil.rmtree(partial, ignore_errors=True)
        if not (folder / "config.json").is_file():
            say(f"could not keep the {mode} {what} in {folder.parent} ({error.strerror or error}); the next "
                "start quantizes it again")
        return
    say(f"kept the {mode} {what} in {folder} ({size / 2**30:.1f} GiB) so the next start skips quantizing "
        f"({CACHE_ENV}=none keeps none)")
