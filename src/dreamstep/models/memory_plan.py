"""The memory plan: the peak device memory of a training run, estimated before any weight loads.

Weights: each component is built on the meta device from its config (the model folder's, or the published
FLUX.1-dev / SDXL configs), so parameters are counted exactly without memory; linear weights are priced
at the quantized size (int8/fp8 1 byte + a per-row scale, nf4 0.5 byte + an fp32 absmax per 64 values),
everything else at the weight dtype. Trainable weights: the LoRA injected on the meta model, fp32, plus
its gradient and the optimizer's two moments. Activations: one forward and backward of the meta model at
the run's resolution and batch, with the run's LoRA and gradient checkpointing, while
:class:`LiveTensorBytes` follows every tensor the ops create and free; attention is priced as a fused
(flash) kernel keeps it, q, k, v, the output and the log-sum-exp, never the N x N scores.

The same :class:`LiveTensorBytes` measures a real run's peak (CPU tensors or CUDA), which is how the
estimate is checked (``tests/models/test_memory_plan.py``, ``benchmarks/memory_plan_check.py``).
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from dreamstep.config.memory import GIB

_BYTES_PER_LINEAR_WEIGHT = {"none": None, "fp8": 1.0, "int8": 1.0, "nf4": 0.5 + 4 / 64}
# Bytes per trainable parameter beyond its fp32 weight: the fp32 gradient and the optimizer's moments.
OPTIMIZER_BYTES = {"AdamW": 4 + 8, "AdamW8bit": 4 + 2, "Prodigy": 4 + 16}
# What a CUDA run needs beyond the tensors (context, cuBLAS workspace, allocator slack), kept free.
HEADROOM_FRACTION = 0.08


class LiveTensorBytes(TorchDispatchMode):
    """Follows the bytes of every tensor storage that the ops run under it create, until it is freed;
    ``peak`` is the most that were alive at once. Storages that existed before (weights, inputs) and views
    of them are not counted."""

    def __init__(self, existing: Iterator[torch.Tensor] = ()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()
        for tensor in existing:
            self._seen[tensor.untyped_storage()] = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage not in self._seen:
                    nbytes = storage.nbytes()
                    self._seen[storage] = nbytes
                    self.live += nbytes
                    weakref.finalize(storage, self._free, nbytes)
        self.peak = max(self.peak, self.live)
        return out


@contextlib.contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    """On the meta device SDPA would take its math path and keep the N x N scores for backward; a GPU
    keeps what a fused kernel keeps (q, k, v, the output, an fp32 log-sum-exp). Route meta inputs to the
    fused CPU kernel's op, whose meta version and backward record exactly that."""
    original = torch.nn.functional.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        if query.device.type != "meta" or attn_mask is not None or enable_gqa:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, scale=scale)[0]

    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def tensors_of(*modules: nn.Module) -> Iterator[torch.Tensor]:
    for module in modules:
        yield from module.parameters()
        yield from module.buffers()


def activation_peak(model: nn.Module, loss_of_one_step: Callable[[], torch.Tensor]) -> int:
    """Peak bytes of the tensors that one forward and backward of ``model`` creates (inputs, activations,
    their gradients, the trainable weights' gradients), on whatever device the model is (meta: no memory
    used, attention priced as a fused kernel keeps it)."""
    with LiveTensorBytes(tensors_of(model)) as tracker, _fused_attention_on_meta():
        loss_of_one_step().backward()
    return tracker.peak


@dataclass(frozen=True)
class PlanOptions:
    """The options of a run that move its peak device memory."""

    resolution: int = 1024
    batch_size: int = 1
    rank: int = 16
    gradient_checkpointing: bool = True
    base_quantization: str = "none"
    text_encoder_quantization: str = "none"
    encoders_on_device: bool = False
    blocks_to_swap: int = 0
    optimizer: str = "AdamW"
    weight_dtype: torch.dtype = torch.bfloat16
    max_sequence_length: int = 512


@dataclass
class Line:
    what: str
    params: int
    precision: str
    nbytes: int


@dataclass
class MemoryPlan:
    options: PlanOptions
    lines: list[Line]

    @property
    def total(self) -> int:
        return sum(line.nbytes for line in self.lines)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_on_meta(cls: type, config: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A diffusers model or transformers encoder from its config, on the meta device (no memory)."""
    with torch.device("meta"), default_dtype(dtype):
        if hasattr(cls, "from_config"):
            return cls.from_config(config)
        config_cls = cls.config_class
        return cls(config_cls(**config))


def weight_bytes(module: nn.Module, quantization: str, dtype_bytes: int, frozen_only: bool = False) -> int:
    """Bytes of a module's weights (``frozen_only``: those without gradients) with its linear weights
    stored as ``quantization`` says."""
    total = sum(p.numel() for p in module.parameters() if not (frozen_only and p.requires_grad))
    per_linear = _BYTES_PER_LINEAR_WEIGHT[quantization]
    if per_linear is None:
        return total * dtype_bytes
    linears = [m for m in module.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]
    linear_params = sum(m.weight.numel() for m in linears)
    rows = sum(m.weight.shape[0] for m in linears)
    scales = rows * 4 if quantization in ("int8", "fp8") else 0  # one fp32 / bf16 scale per output row
    return int((total - linear_params) * dtype_bytes + linear_params * per_linear + scales)


def load_config(folder: Path | None, subfolder: str, fallback: dict[str, Any]) -> dict[str, Any]:
    """``folder/subfolder/config.json`` when there is one, else ``fallback`` (a published config)."""
    if folder is not None and (folder / subfolder / "config.json").is_file():
        return json.loads((folder / subfolder / "config.json").read_text(encoding="utf-8"))
    return fallback


def model_folder(source: str | None) -> Path | None:
    """The local model folder whose configs the plan reads, or ``None`` (a hub id: published configs)."""
    if source is None:
        return None
    path = Path(source).expanduser()
    return path if path.is_dir() else None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def swapped_bytes(blocks: list[nn.Module], blocks_to_swap: int, per_block: Callable[[nn.Module], int]) -> int:
    """Bytes kept off the device by swapping the last ``blocks_to_swap`` blocks to the CPU, less the one
    block that is on its way in at any time."""
    if blocks_to_swap <= 0:
        return 0
    swapped = blocks[-blocks_to_swap:]
    return sum(per_block(b) for b in swapped) - max(per_block(b) for b in swapped)


def _size(nbytes: int) -> str:
    """GiB for full-size models, MiB for the tiny ones (whose plans are all below 0.1 GiB)."""
    return f"{nbytes / GIB:7.2f} GiB" if abs(nbytes) >= GIB / 10 or nbytes == 0 else f"{nbytes / 2**20:7.2f} MiB"


def format_plan(plan: MemoryPlan, device_memory: int | None, measured: int | None = None) -> str:
    """The plan as a table, with the verdict for ``device_memory`` and a measured peak when there is one."""
    rows = ["memory plan: estimated peak device memory"]
    for line in plan.lines:
        params = (f"{line.params / 1e9:.2f}B" if line.params >= 1e8 else
                  f"{line.params / 1e6:.1f}M" if line.params >= 1e5 else f"{line.params / 1e3:.1f}K" if line.params
                  else "")
        rows.append(f"  {line.what:<58} {params:>7} {line.precision:>5} {_size(line.nbytes)}")
    rows.append(f"  {'total':<58} {'':>7} {'':>5} {_size(plan.total)}")
    if measured is not None:
        rows.append(f"  {'measured peak':<58} {'':>7} {'':>5} {_size(measured)}")
    if device_memory is not None:
        usable = device_memory * (1 - HEADROOM_FRACTION)
        verdict = "fits" if plan.total <= usable else "does NOT fit"
        rows.append(f"  device memory {device_memory / GIB:.1f} GiB, {HEADROOM_FRACTION:.0%} kept free "
                    f"for the CUDA context and allocator: {verdict}")
    return "\n".join(rows)


def detected_device_memory() -> int | None:
    """Total memory of the current CUDA device, or ``None`` without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return None


def fits(plan: MemoryPlan, device_memory: int) -> bool:
    return plan.total <= device_memory * (1 - HEADROOM_FRACTION)


def options_that_fit(estimate: Callable[[PlanOptions], MemoryPlan], options: PlanOptions, device_memory: int,
                     *, max_blocks: int, cuda: bool) -> list[tuple[str, MemoryPlan]]:
    """Changes of the memory options that bring the estimate under the card's usable memory, in the order
    that costs least speed and quality: each single change that fits; if none does, the changes together,
    then with the fewest swapped blocks that fit. ``[]`` when nothing fits."""
    steps: list[tuple[str, dict[str, Any]]] = []
    if options.encoders_on_device:
        steps.append(("encoders off the device (cached latents and text)", {"encoders_on_device": False}))
    if not options.gradient_checkpointing:
        steps.append(("--gradient_checkpointing", {"gradient_checkpointing": True}))
    current = _BYTES_PER_LINEAR_WEIGHT[options.base_quantization] or 2
    for mode, label in (("fp8", "--base_quantization fp8 (or int8)"), ("nf4", "--base_quantization nf4")):
        if (cuda or mode != "nf4") and _BYTES_PER_LINEAR_WEIGHT[mode] < current:
            steps.append((label, {"base_quantization": mode}))
    found = [(flags, plan) for flags, change in steps
             if fits(plan := estimate(replace(options, **change)), device_memory)]
    if found:
        return found
    together = replace(options, **{k: v for _, change in steps for k, v in change.items()})
    names = [flags for flags, _ in steps]
    for blocks in range(options.blocks_to_swap, max_blocks + 1):
        plan = estimate(replace(together, blocks_to_swap=blocks))
        if fits(plan, device_memory):
            return [(" + ".join(names + ([f"--blocks_to_swap {blocks}"] if blocks else [])), plan)]
    return []


def suggestion_lines(found: list[tuple[str, MemoryPlan]]) -> str:
    if not found:
        return "  nothing among dreamstep's memory options fits this card; lower --resolution or the batch size"
    return "\n".join(f"  would fit: {flags} ({plan.total / GIB:.2f} GiB)" for flags, plan in found)
