"""The memory plan's figures, kept on disk: a pass over the meta device takes seconds to tens of seconds at full
size, and building the full-size modules to count their weights takes seconds more, while the figures depend only
on the model's structure, the arguments and the code that computes them. So ``plan``, the dashboard's form and
every trainer's check read them back instead of building and measuring again.

The key hashes the model's structure (for a LoRA run, the configs its modules are built from,
:func:`config_fingerprint`; otherwise the modules' parameter names, shapes, dtypes and trainability,
:func:`module_fingerprint`), the arguments, the versions of torch, diffusers, transformers, peft, torchao and
bitsandbytes, and the source of ``dreamstep.models`` (the families' passes, published configs and the method), so
a change to any of them computes afresh. ``DREAMSTEP_PLAN_CACHE`` names the folder (default
``$XDG_CACHE_HOME/dreamstep/plans``); an unwritable folder only means computing every time."""

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
    """``measure()``'s result for these ``modules`` (a fingerprint) and ``arguments``: read back when an earlier run
    measured it, else measured and kept."""
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


def config_fingerprint(folder: Path | None, family: str, variant: str | None, rank: int, lora_layers: list[str]) -> str:
    """What a LoRA run's modules follow from, without building them: the family and variant, the configs the
    family's ``meta_components`` reads from ``folder`` (``model_index.json`` and each part's ``config.json``; none:
    the published ones, in the source), and the LoRA's rank and layers."""
    digest = hashlib.sha256(f"{family}|{variant}|{rank}|{sorted(lora_layers)}|".encode())
    if folder is not None:
        for config in sorted([folder / "model_index.json", *folder.glob("*/config.json")]):
            if config.is_file():
                digest.update(config.relative_to(folder).as_posix().encode() + b"=" + config.read_bytes() + b";")
    return digest.hexdigest()
