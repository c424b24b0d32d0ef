"""What a command that stops with an error must still do before the error leaves it (release an output folder,
say how the run ended). The layer that owns such a thing registers it here; the command line, which must stay
torch-free for ``--help``, calls what was registered without importing that layer."""

from __future__ import annotations

from collections.abc import Callable

_ON_ERROR: list[Callable[[str], None]] = []


def when_a_command_fails(action: Callable[[str], None]) -> None:
    """Call ``action(message)`` whenever a command stops with an error (``message``: the error's first line)."""
    if action not in _ON_ERROR:
        _ON_ERROR.append(action)


def command_failed(message: str) -> None:
    """Run every action registered with :func:`when_a_command_fails`."""
    for action in list(_ON_ERROR):
        action(message)
