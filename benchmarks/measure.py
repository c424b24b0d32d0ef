"""Timing and peak memory for the benchmark scripts: the same measurement for every loop they compare."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


class PeakMemory:
    """Peak memory of a block: CUDA allocator peak on a GPU, else the process's peak RSS (Linux). On a GPU also
    ``reserved_mib``: the most the caching allocator held from the driver meanwhile (what the card must have)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_mib = torch.cuda.max_memory_allocated() / 2**20
            self.reserved_mib = torch.cuda.max_memory_reserved() / 2**20
        else:
            self.peak_mib = self.reserved_mib = process_status_mib("VmHWM")


def process_status_mib(field: str) -> float:
    """A memory field of /proc/self/status (``VmRSS``: resident now, ``VmHWM``: its peak), in MiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def time_steps(run_step: Callable[[], None], steps: int, warmup: int, device: torch.device) -> tuple[float, float]:
    for _ in range(warmup):
        run_step()
    times = []
    with PeakMemory(device) as memory:
        for _ in range(steps):
            times.append(timed(run_step, device))
    return statistics.median(times), memory.peak_mib


def time_alternating(runs: Sequence[Callable[[], None]], steps: int, warmup: int, device: torch.device) -> list[float]:
    """Median seconds per call of each of ``runs``, called in turn (one call of each per round): on a shared,
    noisy machine a slow spell then slows every loop alike, instead of whichever ran during it."""
    for _ in range(warmup):
        for run in runs:
            run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(steps):
        for run, spent in zip(runs, times):
            spent.append(timed(run, device))
    return [statistics.median(spent) for spent in times]


def timed(run: Callable[[], None], device: torch.device) -> float:
    """Seconds one call of ``run`` takes, the device's queue included."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
