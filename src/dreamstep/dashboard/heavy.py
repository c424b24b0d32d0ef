"""The dashboard's imports of torch, diffusers and peft (a LoRA report, a trainer's recipe for the new-run form's plan
and dataset check), one at a time.

The server answers in several threads, and it warms these modules up in another at start-up. Two threads importing
the same library at once can meet a module the other has half made (``ImportError: cannot import name ... from
partially initialized module 'accelerate.state'``); one lock around these imports keeps each library whole. Once a
module is loaded the lock costs nothing but a dictionary lookup.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

_IMPORTING = threading.Lock()


def import_heavy(name: str) -> ModuleType:
    """``importlib.import_module(name)``, while no other thread of the dashboard imports."""
    with _IMPORTING:
        return importlib.import_module(name)
