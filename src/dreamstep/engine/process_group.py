"""The end of a run under ``accelerate launch``: leaving the process group while the interpreter is whole."""

from __future__ import annotations

import gc
import sys


def leave_process_group() -> None:
    """Destroy the process group once the command's work is done.

    Left to the interpreter's exit, gloo's teardown can abort a process whose run finished ("terminate called
    without an active exception", exit code -6; about one run in eight of two CPU processes on a busy machine) and
    the launcher then reports the run as failed. Destroying the group is not enough while a DDP model still holds
    it: the model then goes at the interpreter's exit, and the group with it. So the reference cycles that keep a
    finished trainer's models alive (accelerate's model list, the trainer's closures) are collected first. Call it
    once the models are out of the caller's scope.
    """
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return
    gc.collect()
    distributed.destroy_process_group()
