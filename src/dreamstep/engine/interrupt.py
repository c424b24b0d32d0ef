"""Ctrl-C (SIGINT) and a scheduler's SIGTERM as a request to stop cleanly.

While the loop trains, the first signal only sets a flag: the loop finishes the optimizer step it is in,
the run writes a checkpoint and prints the command that continues it. A second signal aborts at once.
Outside the loop (loading models, filling caches, the final save) there is nothing to finish, so the
first signal aborts at once too. An abort raises :class:`RunInterrupted` (a ``KeyboardInterrupt``, so no
``except Exception`` in a library swallows it) carrying the exit code a shell expects (128 + signal).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

__all__ = ["RunInterrupted", "StopSignals", "take_abort"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_abort: RunInterrupted | None = None  # the abort a signal raised in this process, until the command line takes it


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal; ``str()`` says what was saved and how to continue."""

    def __init__(self, message: str, exit_code: int = 128 + signal.SIGINT):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """Installs handlers for SIGINT and SIGTERM (main thread only; elsewhere it does nothing)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.graceful = False  # True while the loop can stop after its current step
        self.hint = ""  # what an abort at once leaves behind, for its message
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)

    def install(self) -> None:
        global _abort
        if threading.current_thread() is not threading.main_thread():
            return
        _abort = None
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def stop_requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.received is None
        self.received = self.received or signal.Signals(signum)
        if first and self.graceful:
            # os.write, not print: the handler may run in the middle of another write to stderr.
            os.write(2, f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint "
                        "(press Ctrl-C again to stop at once)\n".encode())
            return
        global _abort
        name = signal.Signals(signum).name
        _abort = RunInterrupted(f"stopped by {name} at once" + (f"; {self.hint}" if self.hint else ""), 128 + signum)
        raise _abort


def take_abort() -> RunInterrupted | None:
    """The abort a signal raised since the last run started (and forget it). A library may catch it and raise
    another error instead (diffusers turns anything raised while it imports a pipeline's module, such as
    ``onnx_utils`` importing onnxruntime, into a RuntimeError); that error is still this abort."""
    global _abort
    abort, _abort = _abort, None
    return abort
