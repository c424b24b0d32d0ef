"""Output whose reader went away never stops a command.

``dreamstep train ... | tee log`` and Ctrl-C: the terminal sends SIGINT to ``tee`` too, which ends at once, and
every later write to stdout fails with a broken pipe (EPIPE). The run is then finishing its step and writing a
checkpoint; a failed ``print`` must not cost it that checkpoint. While a command runs, its stdout and stderr
take writes after their reader has gone: the first broken pipe points the stream's file descriptor at the null
device (so later writes from anything, C code and progress bars included, succeed), and the text is dropped.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["ClosedOutputSafe", "output_that_may_close"]


class ClosedOutputSafe:
    """A text stream whose ``write`` and ``flush`` succeed after its pipe's reader has gone; the rest is the
    stream's own."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._to_null_device()
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._to_null_device()

    def _to_null_device(self) -> None:
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self.stream.fileno())
            finally:
                os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def output_that_may_close() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`ClosedOutputSafe` streams for the block."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if isinstance(s, ClosedOutputSafe) or s is None else ClosedOutputSafe(s)
                              for s in saved)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()  # what is left, before the streams without the guard are flushed at exit
        sys.stdout, sys.stderr = saved
