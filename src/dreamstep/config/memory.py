"""The memory options checked at the door, before torch is imported: the quantization modes of a frozen
base or T5 (``--base_quantization``), and memory sizes (``--device_memory 12GB``)."""

from __future__ import annotations

import importlib.util
import os
import re

from dreamstep.errors import UserError

QUANTIZATION_MODES = ("none", "fp8", "int8", "nf4")
QUANTIZATION_EXTRA = "dreamstep[quant]"
# The package each mode needs (installed by QUANTIZATION_EXTRA).
_PACKAGES = {"fp8": "torchao", "int8": "torchao", "nf4": "bitsandbytes"}
GIB = 1024 ** 3


def check_quantization(mode: str, flag: str, *, cuda_available: bool | None = None) -> None:
    """Refuse, before any model loads, a mode that is unknown, whose package is missing, or that needs a
    CUDA GPU this machine lacks."""
    if mode not in QUANTIZATION_MODES:
        raise UserError(f"{flag} '{mode}' is not one of {', '.join(QUANTIZATION_MODES)}")
    if mode == "none":
        return
    if mode == "nf4":
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            raise UserError(f"{flag} nf4 needs a CUDA GPU (bitsandbytes 4-bit); on this machine use "
                            f"{flag} int8 or fp8")
    package = _PACKAGES[mode]
    if importlib.util.find_spec(package) is None:
        raise UserError(f"{flag} {mode} needs the '{package}' package: pip install '{QUANTIZATION_EXTRA}'")


def check_single_file_quantization(mode: str, flag: str, single_file: str | None, file_flag: str) -> None:
    """Refuse nf4 with a single-file checkpoint before anything loads: diffusers' single-file loader (0.42) reads a
    bitsandbytes config as weights saved quantized, and fails on a plain checkpoint after the encoders ran."""
    if mode == "nf4" and single_file is not None:
        raise UserError(f"{flag} nf4 cannot load {file_flag} {single_file}: diffusers' single-file loader quantizes to "
                        f"4 bits only weights saved quantized; give the model's diffusers folder, or use {flag} int8 "
                        "or fp8")


# Optimizer state bytes per trainable parameter, by --optimizer (the plan's table; torch-free for --help).
OPTIMIZER_STATE_BYTES = {"AdamW": 8, "AdamW8bit": 2, "Prodigy": 16}


def parse_bytes(text: str, flag: str) -> int:
    """'12GB', '12 GiB', '24g' or '8000MB' -> bytes (GB and GiB both taken as 2**30: card sizes are)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([GgMm])(?:i?[Bb])?\s*", text)
    if not match:
        raise UserError(f"{flag} '{text}' is not a memory size; write it like 12GB or 8000MB")
    value, unit = float(match.group(1)), match.group(2).upper()
    if value <= 0:
        raise UserError(f"{flag} '{text}': a memory size must be above 0, e.g. 12GB")
    return int(value * (GIB if unit == "G" else 1024 ** 2))


def check_compile(compile_blocks: bool, mode: str, flag: str) -> None:
    """``--compile`` cannot trace blocks whose weights are torchao tensors: torch 2.13 refuses outputs that
    alias tensor-subclass inputs (measured with int8 and fp8 bases on the tiny FLUX)."""
    if compile_blocks and mode in ("int8", "fp8"):
        raise UserError(f"--compile cannot compile blocks with {flag} {mode} weights (torch.compile refuses torchao's "
                        f"weight tensors there); drop --compile, or train on a bf16 or nf4 base")


def use_expandable_segments() -> None:
    """Let PyTorch's CUDA allocator grow its segments in place (``expandable_segments``) unless the user configured
    the allocator (``PYTORCH_CUDA_ALLOC_CONF``, or torch's newer ``PYTORCH_ALLOC_CONF``): block swapping and the
    phases free and allocate large buffers all run long, which fixed-size segments fragment, so the allocator
    reserves well past what is allocated. Takes effect only when set before CUDA initialises."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
