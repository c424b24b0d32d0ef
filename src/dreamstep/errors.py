"""User-facing errors: one line that names the file, key or flag and the fix."""

from __future__ import annotations

import contextlib
import difflib
import pickle
from collections.abc import Iterable, Iterator
from pathlib import Path


class UserError(Exception):
    """Bad input from the user. The CLI prints the message alone (no traceback) and exits with 2."""


def cannot_load(flag: str, model_id: str, what: str, error: Exception, otherwise: str) -> UserError:
    """One line for a model that would not load: a local folder is damaged (download advice would mislead), a
    hub id is not at hand offline, or the loader's first line says why. ``otherwise`` ends the advice for a hub
    id (``give a local folder``)."""
    from dreamstep.models.sources import HUB_ID

    text = str(error).strip()
    reason = text.splitlines()[0] if text else type(error).__name__
    if not Path(model_id).expanduser().exists() and not HUB_ID.fullmatch(model_id):
        return UserError(f"{flag} {model_id}: no such folder, and not a hub id (owner/name); check the path")
    if Path(model_id).is_dir():
        return UserError(f"{flag} {model_id}: cannot load the {what} from this folder ({reason}); fix or download "
                         "the folder again, or give the hub id")
    if any(word in text.lower() for word in ("offline", "connect", "cache")):
        reason = "it is not in the local Hugging Face cache and the hub is offline or unreachable"
    return UserError(f"{flag} {model_id}: cannot load the {what} ({reason}); download it once with network access "
                     f"(unset HF_HUB_OFFLINE), or {otherwise}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return " (did you mean 'x'?)" for the closest choice, or "" when nothing is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def is_refused_pickle(error: BaseException) -> bool:
    """Whether ``error`` is torch's ``weights_only`` loader refusing a pickle that holds more than tensors
    (nothing in it ran; torch's own message suggests loading it unsafely, which is not advice to pass on)."""
    return "Weights only load failed" in str(error)


@contextlib.contextmanager
def refusing_pickled_code(source: str | Path, flag: str) -> Iterator[None]:
    """Turn a model loader's refusal of a pickle that holds more than tensors (torch's ``weights_only``
    loading, which transformers and diffusers use for ``.bin`` weights) into one line naming the file:
    nothing in it ran, and the fix is the model's safetensors weights. ``flag`` names the option that gave
    ``source``."""
    try:
        yield
    except pickle.UnpicklingError as error:
        if not is_refused_pickle(error):
            raise
        folder = Path(source).expanduser()
        files = sorted(p for p in folder.rglob("*") if p.suffix in _PICKLE_SUFFIXES) if folder.is_dir() else []
        which = str(files[0]) if len(files) == 1 else "one of its pickled weights files"
        raise UserError(f"{flag} {source}: {which} holds objects other than tensors, which may run code, so it was "
                        "not loaded (nothing in it ran); use the model's .safetensors weights") from None
