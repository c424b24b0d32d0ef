"""User-facing errors: one line that names the file, key or flag and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """Bad input from the user. The CLI prints the message alone (no traceback) and exits with 2."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return " (did you mean 'x'?)" for the closest choice, or "" when nothing is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
