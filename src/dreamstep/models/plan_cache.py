"""The memory plan's measured passes, kept on disk: a pass over the meta device takes seconds to tens of seconds
at full size, and its result depends only on the model's structure, the pass's arguments and the code that runs
it, so ``plan``, the dashboard's form and every trainer's check read it back instead of measuring again.

The key hashes the modules' parameter names, shapes, dtypes and trainability, the pass's arguments, the versions of
torch, diffusers, transformers and peft, and the source of ``dreamstep.models`` (the families' passes and the
method), so a change to any of them measures afresh. ``DREAMSTEP_PLAN_CACHE`` names the folder (default
``$XDG_CACHE_HOME/dreamstep/plans``); an unwritable folder only means measuring every time."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from functools import cache
from importlib import metadata
from pathlib import Path

from torch import nn

CACHE_ENV = "DREAMSTEP_PLAN_CACHE"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dreamstep" / "plans"


@cache
def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    for package in ("torch", "diffusers", "transformers", "peft", "torchao", "bitsandbytes"):
        try:
            digest.update(f"{package}={metadata.version(package)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package}=none;".encode())
    models = Path(__file__).parent
    for source in sorted(models.rglob("*.py")):
        digest.update(source.relative_to(models).as_posix().encode() + source.read_bytes())
    return digest.hexdigest()


def module_fingerprint(modules: dict[str, nn.Module]) -> str:
    """What a pass's memory depends on in the modules: their classes and every parameter's and buffer's name,
    shape, dtype and trainability."""
    digest = hashlib.sha256()
    for label, module in modules.items():
        digest.update(f"{label}:{type(module).__qualname__};".encode())
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}{tensor.requires_grad};".encode())
    return digest.hexdigest()


def remembered(modules: str, what: str, arguments: tuple, measure: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
    """``measure()``'s result for these ``modules`` (:func:`module_fingerprint`) and ``arguments``: read back when an
    earlier run measured it, else measured and kept."""
    key = hashlib.sha256(f"{_code_fingerprint()}|{modules}|{what}|{arguments!r}".encode()).hexdigest()
    path = cache_dir() / f"{key}.json"
    try:
        return tuple(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    result = tuple(int(value) for value in measure())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(result))
        partial.replace(path)
    except OSError:
        pass
    return result
