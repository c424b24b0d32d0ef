"""The precision policy of FLUX/SDXL LoRA and ControlNet training, that of diffusers' training scripts.

=============  ===================  =====================================
               frozen weights       trainable weights (LoRA, ControlNet)
=============  ===================  =====================================
parameters     bf16 / fp16          fp32
computation    bf16 / fp16          bf16 / fp16 (autocast)
=============  ===================  =====================================

Frozen weights are only read, so half precision halves their memory at no cost to training. Trainable
weights stay fp32 because the optimizer updates them in their own dtype: fp16/bf16 updates of
``lr * grad`` (often below 1e-3 of the weight) round away or overflow.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from dreamstep.config.choices import DTYPE_NAMES
from dreamstep.errors import UserError, did_you_mean

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float16, torch.bfloat16)))
# --mixed_precision "no" and sd-scripts' --save_precision "float" both mean fp32.
_ALIASES = {"no": "fp32", "float": "fp32"}


def dtype_named(name: str, flag: str) -> torch.dtype:
    """The dtype of a precision name: fp32 (also "no" and "float"), fp16 or bf16; another name is an
    error that names ``flag``."""
    if _ALIASES.get(name, name) not in DTYPES:
        names = [*DTYPES, *_ALIASES]
        raise UserError(f"{flag} '{name}' is not one of {', '.join(names)}{did_you_mean(name, names)}")
    return DTYPES[_ALIASES.get(name, name)]


def weight_dtype_for(mixed_precision: str) -> torch.dtype:
    """dtype of the frozen weights for ``--mixed_precision`` ("no", "fp32", "fp16" or "bf16")."""
    return dtype_named(mixed_precision, "--mixed_precision")


def freeze(*modules: torch.nn.Module | None) -> None:
    """Stop gradients to every parameter of the given modules (``None`` entries are skipped)."""
    for module in modules:
        if module is not None:
            module.requires_grad_(False)


def cast_trainable_params_to_fp32(*modules: torch.nn.Module) -> int:
    """Upcast the parameters that require gradients to fp32, in place; return how many there were.

    Call after casting the model to the half-precision weight dtype and adding adapters.
    """
    count = 0
    for module in modules:
        for param in module.parameters():
            if param.requires_grad:
                param.data = param.data.float()
                count += 1
    return count


def autocast(device_type: str, mixed_precision: str) -> contextlib.AbstractContextManager:
    """Half-precision compute for ``fp16``/``bf16`` (fp32 weights are cast per op), else nothing."""
    dtype = weight_dtype_for(mixed_precision)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def compute_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` now, or ``None`` while autocast is off there (or has no
    such device: ``meta``, where the plan builds full-size models)."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def in_compute_dtype(inputs: Any, device_type: str) -> Any:
    """``inputs`` (a tensor, or dicts, lists and tuples of them) with every floating-point tensor in the dtype
    autocast computes in on ``device_type`` (unchanged while it is off): the denoiser's inputs as diffusers'
    training scripts give them (``model_input.to(dtype=weight_dtype)``, prompt embeddings in ``weight_dtype``). The
    caches hold fp32; fed as they are, a quantized linear, which returns its input's dtype, would make the
    residual stream fp32."""
    dtype = compute_dtype(device_type)
    if dtype is None:
        return inputs
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, inputs)


def choose_device(name: str | None) -> torch.device:
    """``name``, or the best available: CUDA, then Apple MPS, then the CPU."""
    if name is not None:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise UserError(f"--device {name}: not a device name; use cpu, cuda, cuda:1 or mps") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
