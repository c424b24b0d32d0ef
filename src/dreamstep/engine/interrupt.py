"""Ctrl-C (SIGINT) and a scheduler's SIGTERM as a request to stop cleanly.

While the loop trains, the first signal only sets a flag: the loop finishes the optimizer step it is in,
the run writes a checkpoint and prints the command that continues it. A second signal aborts at once.
Outside the loop (loading models, filling caches, the final save) there is nothing to finish, so the
first signal aborts at once too. An abort raises :class:`RunInterrupted` (a ``KeyboardInterrupt``, so no
``except Exception`` in a library swallows it) carrying the exit code a shell expects (128 + signal).

A ``train`` command has handlers from its first line (:func:`command_signals`; ``python -m dreamstep train``
installs them before it imports anything else), so no signal is dropped while it starts, also when it was
started with SIGINT ignored, as background jobs and some launchers are. While the libraries are imported
(:func:`held_while_importing`) the first signal is held until the import ends: an exception raised into the
middle of an import can leave a library's modules half made (numpy then recurses without end on its next
import), and no longer stops the command. Once a command stops at once, further signals are ignored: they
would cut short the cleanup (the run's status, its lock) and the message that says what was kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["RunInterrupted", "StopSignals", "command_signals", "held_while_importing", "hold_from_the_start",
           "take_abort"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_abort: RunInterrupted | None = None  # the abort a signal raised in this process, until the command line takes it
GRACEFUL = "finishing this step and saving a checkpoint"


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal; ``str()`` says what was saved and how to continue."""

    def __init__(self, message: str, exit_code: int = 128 + signal.SIGINT):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """Installs handlers for SIGINT and SIGTERM (main thread only; elsewhere it does nothing)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.waiting: str | None = None  # while set, a first signal waits for this (e.g. GRACEFUL) to stop
        self.hint = ""  # what an abort at once leaves behind, for its message
        self._previous: dict[int, Any] = {}
        self._stopping = False  # an abort at once was raised: the command is on its way out

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)

    @staticmethod
    def installed() -> StopSignals | None:
        """The StopSignals whose handler SIGINT has now, if any."""
        owner = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
        return owner if isinstance(owner, StopSignals) else None

    def install(self) -> None:
        """Take over the signals; a signal the handlers before these received (and that did not stop the
        command: a library caught the abort) stops it now."""
        global _abort
        if threading.current_thread() is not threading.main_thread():
            return
        before = StopSignals.installed()
        if before is not None and before.received is not None:
            self.received = before.received
            raise self._abort_now("at once")
        _abort = None
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the signals back; handlers of ours taken back learn that the command is stopping."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        before = StopSignals.installed()
        if before is not None and self.received is not None:
            before.received = before.received or self.received
            before._stopping = True

    def stop_requested(self) -> bool:
        return self.received is not None

    @contextlib.contextmanager
    def held(self, until: str) -> Iterator[None]:
        """A first signal during the block waits for its end (``until`` says so) and then stops the command."""
        self.waiting = until
        try:
            yield
        finally:
            self.waiting = None
        if self.received is not None:
            raise self._abort_now("before the run started")

    def _handle(self, signum: int, frame: Any) -> None:
        if self._stopping:
            return
        first = self.received is None
        if first:
            self.received = signal.Signals(signum)
        if first and self.waiting:
            _tell(f"\n{signal.Signals(signum).name}: {self.waiting} (press Ctrl-C again to stop at once)\n")
            return
        raise self._abort_now("at once", signum)

    def _abort_now(self, how: str, signum: int | None = None) -> RunInterrupted:
        global _abort
        self._stopping = True
        sig = signal.Signals(signum) if signum is not None else self.received or signal.SIGINT
        _abort = RunInterrupted(f"stopped by {sig.name} {how}" + (f"; {self.hint}" if self.hint else ""), 128 + sig)
        return _abort


def _tell(text: str) -> None:
    """Write to stderr from a signal handler: os.write, not print (the handler may run in the middle of another
    write to stderr), and a closed stderr (its pipe's reader ended) must not stop the run."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


@contextlib.contextmanager
def command_signals() -> Iterator[StopSignals]:
    """A command's handlers from its start to its end: those installed already (``python -m dreamstep train``
    installs them before its imports), else new ones; at the end the signals are handled as before again."""
    signals = StopSignals.installed()
    if signals is None:
        signals = StopSignals()
        signals.install()
    try:
        yield signals
    finally:
        signals.uninstall()


_LOADING = "stopping once the libraries have loaded"


def hold_from_the_start() -> None:
    """Handlers before anything else is imported (``python -m dreamstep train``), holding a first signal until
    the trainer's libraries have loaded, where :func:`held_while_importing` stops the command."""
    signals = StopSignals()
    signals.waiting = _LOADING
    signals.install()


@contextlib.contextmanager
def held_while_importing() -> Iterator[None]:
    """Hold a first signal until the block's imports end (see the module docstring), when handlers of ours are in."""
    signals = StopSignals.installed()
    with signals.held(_LOADING) if signals is not None else contextlib.nullcontext():
        yield


def take_abort() -> RunInterrupted | None:
    """The abort a signal raised since the last run started (and forget it). A library may catch it and raise
    another error instead (diffusers turns anything raised while it imports a pipeline's module, such as
    ``onnx_utils`` importing onnxruntime, into a RuntimeError); that error is still this abort."""
    global _abort
    abort, _abort = _abort, None
    return abort
