"""Stand-ins for the CUDA-only runtime pieces (streams, events, ``record_stream``, pinned host memory, the
fp16 GradScaler that accelerate builds on a GPU), so the code that only runs on a GPU runs in CI on a CPU.

:class:`CudaRuntime` replaces, for one test (through pytest's ``monkeypatch``), ``torch.cuda.Stream``,
``Event``, ``current_stream``, ``stream``, the tensor methods ``record_stream`` and ``pin_memory`` and
``torch.empty``'s ``pin_memory=True``, and watches ``Tensor.copy_``. It computes nothing itself: it writes
what the code asked for into ``log``, in order, so a test can check the order of copies, event records and
waits. Pinned memory is an ordinary CPU tensor remembered as pinned, with the size torch's pinned allocator
would really reserve for it (the next power of two).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.utils._python_dispatch


@dataclass(eq=False)
class Stream:
    name: str

    def wait_event(self, event: Event) -> None:
        event.runtime.log.append(("wait", self, event))


@dataclass(eq=False)
class Event:
    runtime: CudaRuntime

    def record(self, stream: Stream | None = None) -> None:
        self.runtime.log.append(("record", stream or self.runtime.current, self))


def storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The memory a tensor views: the same object for every view of it (meta tensors included)."""
    return tensor.untyped_storage()


@dataclass(eq=False)
class CudaRuntime:
    """Log entries (tensors by their storage): ``("copy", stream, destination, source, non_blocking)`` for
    copies onto ``device``; ``("host", destination)`` for copies into pinned memory; ``("record", stream,
    event)``, ``("wait", stream, event)``, ``("record_stream", tensor, stream)``."""
    device: torch.device
    log: list[tuple] = field(default_factory=list)
    pinned: list[torch.Tensor] = field(default_factory=list)
    on_host_copy: Callable[[], None] | None = None  # called at each copy into pinned memory
    log_copies: bool = True  # off for a memory measurement: the log would keep every storage it names alive
    # (those copied, and those given to record_stream)
    pinned_limit: int | None = None  # bytes the pinned allocator gives before it fails, as CUDA's does

    def __post_init__(self) -> None:
        self.compute = Stream("compute")
        self.current = self.compute
        self.side_streams: list[Stream] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> CudaRuntime:
        original_copy = torch.Tensor.copy_
        monkeypatch.setattr(torch.cuda, "Stream", self._new_stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: Event(self))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self._use_stream)
        # Tensor methods must be plain functions (the tensor comes first), not bound methods of the runtime.
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: self._record_stream(tensor, stream))
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor, device=None: self._pin_memory(tensor))
        original_empty = torch.empty

        def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            if not pin_memory:
                return original_empty(*args, **kwargs)
            # Allocated outside any dispatch mode: a measurement of device memory never sees host memory.
            with torch.utils._python_dispatch._disable_current_modes():
                pinned = original_empty(*args, **kwargs)
            self._take_pinned(pinned)
            return pinned

        monkeypatch.setattr(torch, "empty", empty)

        def copy(destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            self._log_copy(destination, source, non_blocking)
            return original_copy(destination, source, non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", copy)
        return self

    def is_pinned(self, tensor: torch.Tensor | torch.UntypedStorage) -> bool:
        memory = tensor if isinstance(tensor, torch.UntypedStorage) else storage(tensor)
        return any(memory is storage(chunk) for chunk in self.pinned)

    @property
    def pinned_bytes(self) -> int:
        """What torch's pinned allocator would reserve: each allocation rounded up to a power of two."""
        return sum(1 << (chunk.nbytes - 1).bit_length() for chunk in self.pinned)

    def entries(self, kind: str) -> list[tuple]:
        return [entry for entry in self.log if entry[0] == kind]

    def _new_stream(self, device: Any = None, priority: int = 0) -> Stream:
        stream = Stream(f"side {len(self.side_streams)}")
        self.side_streams.append(stream)
        return stream

    @contextlib.contextmanager
    def _use_stream(self, stream: Stream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def _record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, Stream), stream
        if self.log_copies:
            self.log.append(("record_stream", storage(tensor), stream))

    def _pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.clone()
        self._take_pinned(pinned)
        return pinned

    def _take_pinned(self, pinned: torch.Tensor) -> None:
        if self.pinned_limit is not None and self.pinned_bytes + (1 << (pinned.nbytes - 1).bit_length()) > \
                self.pinned_limit:
            raise RuntimeError("CUDA error: out of memory")  # what cudaHostAlloc's failure raises
        self.pinned.append(pinned)

    def _log_copy(self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        if not self.log_copies:
            return
        if destination.device == self.device and source.device.type == "cpu":
            self.log.append(("copy", self.current, storage(destination), storage(source), non_blocking))
        elif self.is_pinned(destination):
            self.log.append(("host", storage(destination)))
            if self.on_host_copy is not None:
                self.on_host_copy()


def fp16_accelerator_as_on_cuda(**kwargs: Any) -> Any:
    """``make_accelerator(mixed_precision="fp16")`` as accelerate builds it on a GPU: native autocast (here
    the CPU's fp16 autocast) and a GradScaler made from the accelerator's own GradScaler settings (here
    torch's CPU GradScaler; accelerate skips both on a CPU)."""
    from dreamstep.engine.train_step import make_accelerator

    accelerator = make_accelerator(mixed_precision="fp16", **kwargs)
    return on_cuda_with_scaler(accelerator)


def on_cuda_with_scaler(accelerator: Any) -> Any:
    handler = accelerator.scaler_handler
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", **(handler.to_kwargs() if handler is not None else {}))
    return accelerator
