"""The memory plan: the peak device and host memory of each phase of a training run (class images with prior
preservation, encode images, encode text, load, train, validate: :mod:`dreamstep.models.phases`), estimated before any
weight loads.

Weights: each component is built on the meta device from its config (the model folder's, or the published
FLUX.1-dev / SDXL configs), so parameters are counted exactly without memory; linear weights are priced
at the quantized size (int8/fp8 1 byte + a per-row scale, nf4 0.5 byte + an fp32 absmax per 64 values),
everything else at the weight dtype. A component is priced on the device in the phases it is there, in host
memory in the others; swapped blocks are in host memory at their size, two of them on the device at a time.
Trainable weights: the LoRA injected on the meta model, fp32, plus the optimizer's state. Passes: one
training step of the meta model at the run's resolution and batch (activations and gradients), with the
run's LoRA and gradient checkpointing and the trainer's dtypes (the cached inputs cast to the compute dtype, as
:func:`dreamstep.models.precision.in_compute_dtype` casts them, under autocast, which the meta device lacks and
:class:`_MetaAutocast` stands in for, with the quantized linears computing in the autocast dtype and no dequantized
weight kept for backward); the encoders' passes while they encode; an inference forward and the
VAE's decode at validation. Attention is priced as a fused (flash) kernel keeps it: q, k, v, the output and the
log-sum-exp, never the N x N scores.

The same :class:`LiveTensorBytes` measures a real run's peak (CPU tensors or CUDA), which is how the
estimate is checked (``tests/models/test_plan_phases.py``, ``benchmarks/memory_plan_check.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from dreamstep.config.memory import GIB
from dreamstep.models.blocks import swapped_blocks as blocks_the_trainer_swaps

# nf4-packed: the 4-bit values alone, without the fp32 absmax per 64 values that stays with the quantization state.
_BYTES_PER_LINEAR_WEIGHT = {"none": None, "fp8": 1.0, "int8": 1.0, "nf4": 0.5 + 4 / 64, "nf4-packed": 0.5}
# Bytes of optimizer state per trainable parameter (the fp32 gradients are counted by the training pass).
# Kept free beside the plan's tensors: cuBLAS and attention workspaces, the allocator's rounding and fragmentation
# (with expandable segments, config.memory.use_expandable_segments, little), and the CUDA context when the card's
# memory is given rather than read from the driver.
RESERVE_BYTES = GIB
# Kept free beside the plan's host lines: the system, and this process's own (Python, torch and the libraries'
# code, the data loader).
HOST_RESERVE_BYTES = 4 * GIB


class LiveTensorBytes(TorchDispatchMode):
    """Follows the bytes of every tensor storage that the ops run under it create, until it is freed;
    ``peak`` is the most that were alive at once. Storages that existed before (weights, inputs) and views
    of them are not counted, nor those ``in_host_memory`` tells apart (a run's pinned host copies, on a CPU)."""

    def __init__(self, existing: Iterator[torch.Tensor] = (),
                 in_host_memory: Callable[[torch.Tensor], bool] | None = None):
        super().__init__()
        self.in_host_memory = in_host_memory
        self.live = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()
        for tensor in existing:
            for plain in _plain_tensors(tensor):
                self._seen[plain.untyped_storage()] = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage not in self._seen and self.in_host_memory is not None and self.in_host_memory(tensor):
                    self._seen[storage] = 0
                elif storage not in self._seen:
                    nbytes = storage.nbytes()
                    self._seen[storage] = nbytes
                    self.live += nbytes
                    weakref.finalize(storage, self._free, nbytes)
        self.peak = max(self.peak, self.live)
        return out


_F = torch.nn.functional
# The functions that autocast runs in half precision, and (CUDA only) those it runs in fp32 whatever their inputs;
# a CPU keeps the norms and softmax in their input's dtype. These are the forms FLUX, SDXL and their encoders call.
_HALF_FUNCTIONS = ("linear", "conv2d", "scaled_dot_product_attention")
_FP32_FUNCTIONS_CUDA = ("layer_norm", "group_norm", "softmax", "log_softmax")
# A quantized frozen linear under autocast, as the trainer's base computes it (torchao 0.18, bitsandbytes): its input
# in the autocast dtype (quantization.keep_only_quantized_weights casts it, as autocast does a plain linear's), so
# its output is in that dtype too; and the bytes per weight element that its dequantization holds while the matmul
# runs, in forward and in backward (forward: torchao's weight-only int8 casts the int8 values to bf16; fp8 takes
# the values to fp32, scales them in fp32, then casts to bf16; bitsandbytes dequantizes a 4-bit weight to bf16 on
# CUDA. Backward: the weight's dequantize(), torchao's through fp32 for both. Measured on the CPU with
# LiveTensorBytes, benchmarks/quantized_step_dtypes.py; torchao runs the same generic ops on CUDA). None keeps a
# dequantized copy for backward (keep_only_quantized_weights gives backward the quantized weight).
QUANTIZED_LINEAR_BYTES = {"int8": (2, 6), "fp8": (10, 10), "nf4": (2, 2)}


@contextlib.contextmanager
def _dequantized_on_meta(weight: torch.Tensor, dtype: torch.dtype, nbytes: int) -> Iterator[torch.Tensor]:
    """A quantized ``weight``'s dequantized copy in ``dtype`` and the steps to it (``nbytes`` per element in all):
    fresh tensors, alive while the matmul that reads them runs."""
    dequantized = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    steps = torch.empty(weight.numel() * max(0, nbytes - dequantized.itemsize), dtype=torch.uint8,
                        device=weight.device)
    yield dequantized
    del dequantized, steps


class _FrozenQuantizedLinear(torch.autograd.Function):
    """A frozen quantized linear on the meta device as the trainer's base computes it
    (:class:`dreamstep.models.quantization.FrozenWeightLinear`): backward keeps the (resident) weight and nothing
    else of its size, and forward and backward each dequantize it while their matmul runs, at the costs of
    :data:`QUANTIZED_LINEAR_BYTES`."""

    @staticmethod
    def forward(ctx: Any, linear: Callable[..., Any], x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, nbytes: tuple[int, int]) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.backward_bytes = nbytes[1]
        with _dequantized_on_meta(weight, x.dtype, nbytes[0]) as values:
            y = linear(x, values)
        return y + bias.to(y.dtype) if bias is not None else y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None, None]:
        (weight,) = ctx.saved_tensors
        with _dequantized_on_meta(weight, grad.dtype, ctx.backward_bytes) as values:
            return None, grad @ values, None, None, None


class _MetaAutocast:
    """Autocast for the meta device (which torch's autocast refuses) with ``device_type``'s policy, and the
    linears whose weights are in ``quantized`` (weight -> mode) computed as :data:`QUANTIZED_LINEAR_BYTES` says. The
    functions are replaced module-wide rather than through a mode, so the forward that a checkpointed block
    recomputes in backward (on autograd's thread) is cast the same way; the casts happen above autograd, as
    autocast's do, so backward keeps the half-precision copies it would."""

    def __init__(self, dtype: torch.dtype | None, device_type: str, quantized: dict[nn.Parameter, str] | None):
        self.dtype = dtype
        self.fp32 = _FP32_FUNCTIONS_CUDA if device_type == "cuda" else ()
        self.quantized = WeakIdKeyDictionary(quantized or {})
        self.cast_cache = WeakIdKeyDictionary()  # autocast keeps its casts of trainable leaf weights while it is on

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype):
            return value
        if not (value.is_leaf and value.requires_grad):
            return value.to(dtype)
        if value not in self.cast_cache:
            self.cast_cache[value] = value.to(dtype)
        return self.cast_cache[value]

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        dtype = torch.float32 if name in self.fp32 else self.dtype

        def cast_and_call(*args: Any, **kwargs: Any) -> Any:
            if name == "linear" and len(args) > 1 and args[1] in self.quantized:
                return self._quantized_linear(original, self.quantized[args[1]], *args, **kwargs)
            first = args[0] if args else next(iter(kwargs.values()))
            if dtype is not None and isinstance(first, torch.Tensor) and first.device.type == "meta":
                args = [self._cast(a, dtype) for a in args]
                kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
            return original(*args, **kwargs)

        return cast_and_call

    def _quantized_linear(self, linear: Callable[..., Any], mode: str, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
        # The input in the compute dtype, as quantization.keep_only_quantized_weights casts it (above autograd).
        x = x.to(self.dtype or weight.dtype)
        return _FrozenQuantizedLinear.apply(linear, x, weight, bias, QUANTIZED_LINEAR_BYTES[mode])

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        names = [n for n in (*_HALF_FUNCTIONS, *self.fp32) if self.dtype is not None or n == "linear"]
        originals = {name: getattr(_F, name) for name in names}
        for name, original in originals.items():
            setattr(_F, name, self._wrap(name, original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(_F, name, original)
            self.cast_cache.clear()


@contextlib.contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    """On the meta device SDPA would take its math path and keep the N x N scores for backward; a GPU
    keeps what a fused kernel keeps (q, k, v, the output, an fp32 log-sum-exp). Route meta inputs to the
    fused CPU kernel's op, whose meta version and backward record exactly that (with a mask or bias too, which
    the fused kernels take as it is)."""
    original = torch.nn.functional.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        if query.device.type != "meta" or enable_gqa:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype != torch.bool:  # an additive bias (T5's), as a fused kernel
            attn_mask = attn_mask.to(query.dtype)                      # takes it
        elif attn_mask is not None:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensor itself, or the inner tensors of a quantized one (torchao's data and scales), which hold its bytes:
    the views a quantized linear takes of them are not new memory."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(tensor, name))
    else:
        yield tensor


def input_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the trainer feeds ``model``'s inputs in (:func:`dreamstep.models.precision.in_compute_dtype`), and
    a pipeline does: that of its frozen weights (bf16 under --mixed_precision bf16, fp32 without it)."""
    return next(p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point())


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, counting the inner tensors of a quantized one (torchao's data and scales)."""
    return sum(plain.untyped_storage().nbytes() for plain in _plain_tensors(tensor))


def tensors_of(*modules: nn.Module) -> Iterator[torch.Tensor]:
    for module in modules:
        yield from module.parameters()
        yield from module.buffers()


def pass_peak(model: nn.Module, one_pass: Callable[[], torch.Tensor | None], *, autocast: torch.dtype | None = None,
              device_type: str = "cuda", quantized: dict[nn.Parameter, str] | None = None) -> int:
    """Peak bytes of the tensors that ``one_pass`` creates beyond ``model``'s weights: a training step's inputs,
    activations and gradients when it returns a loss (backward runs here), or an inference pass's when it
    returns ``None``. On the meta device no memory is used, attention is priced as a fused kernel keeps it, and
    ``autocast`` (the half dtype, or ``None`` for fp32) follows ``device_type``'s policy, with the linears of
    ``quantized`` computed as the quantized base's are."""
    casts = _MetaAutocast(autocast, device_type, quantized)
    with LiveTensorBytes(tensors_of(model)) as tracker, _fused_attention_on_meta(), casts.applied():
        loss = one_pass()
        if loss is not None:
            loss.backward()
        del loss
    return tracker.peak


@dataclass(frozen=True)
class PlanOptions:
    """The options of a run that move its peak memory. ``encoders_on_device``: the loop itself needs an
    encoder (a text encoder that trains, or the VAE for latents that are not cached), which then stays on the
    device while training; ``validation_images``: validation generates images (the VAE decodes them), not only
    the validation loss; ``image_token_multiplier``: how many images' tokens the FLUX transformer reads per
    sample (2 for a model that reads a condition image's tokens beside the target's); ``t5_trains``: FLUX's T5
    runs in the loop too (flux-kohya's ``train_t5xxl``); ``sd_scripts_swap``: ``blocks_to_swap`` counts as
    sd-scripts' FLUX flag does (flux-kohya; :func:`dreamstep.models.blocks.swapped_blocks`); ``class_images_batch``:
    prior preservation makes class images this many at a time (the pipeline's batch) before the run, in a phase of
    their own; 0: none to make."""

    resolution: int = 1024
    batch_size: int = 1
    rank: int = 16
    gradient_checkpointing: bool = True
    cpu_offload_checkpointing: bool = False
    base_quantization: str = "none"
    text_encoder_quantization: str = "none"
    encoders_on_device: bool = False
    t5_trains: bool = False
    blocks_to_swap: int = 0
    sd_scripts_swap: bool = False
    optimizer: str = "AdamW"
    weight_dtype: torch.dtype = torch.bfloat16
    max_sequence_length: int = 512
    validation_images: bool = True
    image_token_multiplier: int = 1
    class_images_batch: int = 0


@dataclass
class Line:
    what: str
    params: int
    precision: str
    nbytes: int


@dataclass
class Phase:
    """One phase of a run: what is on the device (``resident``: the components there, by pipeline name) and what
    waits in host memory, line by line."""

    name: str
    resident: tuple[str, ...]
    device: list[Line]
    host: list[Line]

    @property
    def device_total(self) -> int:
        return sum(line.nbytes for line in self.device)

    @property
    def host_total(self) -> int:
        return sum(line.nbytes for line in self.host)


@dataclass
class MemoryPlan:
    options: PlanOptions
    phases: list[Phase]

    @property
    def total(self) -> int:
        """The peak device memory: that of the phase that needs the most."""
        return max(phase.device_total for phase in self.phases)

    @property
    def host_total(self) -> int:
        return max(phase.host_total for phase in self.phases)

    def phase(self, name: str) -> Phase:
        return next(phase for phase in self.phases if phase.name == name)


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
    stored as ``quantization`` says, except those that transformers keeps out of 4-bit: its
    ``_keep_in_fp32_modules`` (T5's ``wo``, in the load dtype), which bitsandbytes' loader skips."""
    total = sum(p.numel() for p in module.parameters() if not (frozen_only and p.requires_grad))
    per_linear = _BYTES_PER_LINEAR_WEIGHT[quantization]
    if per_linear is None:
        return total * dtype_bytes
    kept = set(getattr(module, "_keep_in_fp32_modules", None) or ()) if quantization.startswith("nf4") else set()
    linears = [m for name, m in module.named_modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad
               and not kept & set(name.split("."))]
    linear_params = sum(m.weight.numel() for m in linears)
    rows = sum(m.weight.shape[0] for m in linears)
    scales = rows * 4 if quantization in ("int8", "fp8") else 0  # one fp32 / bf16 scale per output row
    return int((total - linear_params) * dtype_bytes + linear_params * per_linear + scales)


def load_config(folder: Path | None, subfolder: str, fallback: dict[str, Any]) -> dict[str, Any]:
    """``folder/subfolder/config.json`` when there is one, else ``fallback`` (a published config)."""
    if folder is not None and (folder / subfolder / "config.json").is_file():
        return json.loads((folder / subfolder / "config.json").read_text(encoding="utf-8"))
    return fallback


def components_on_meta(folder: Path | None, parts: dict[str, tuple[type, dict[str, Any]]]) -> dict[str, nn.Module]:
    """A family's components on the meta device: ``parts`` maps each pipeline component to its class and the
    published config used when ``folder`` has none of its own (:func:`load_config`)."""
    return {name: build_on_meta(cls, load_config(folder, name, fallback)) for name, (cls, fallback) in parts.items()}


def model_folder(source: str | None) -> Path | None:
    """The local model folder whose configs the plan reads: the folder given, or a hub model's snapshot in the local
    Hugging Face cache (its configs only); ``None``: published configs (a hub model not downloaded yet)."""
    if source is None:
        return None
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.count("/") != 1:
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=["model_index.json", "*/config.json"],
                                      local_files_only=True))
    except Exception:  # not in the local cache, or not a hub id at all: the published configs
        return None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def swapped_blocks(base: nn.Module, options: PlanOptions) -> tuple[list[nn.Module], list[nn.Module]]:
    """The blocks the trainer swaps for ``options`` (:func:`dreamstep.models.blocks.swapped_blocks`), and of them the
    two largest: the swapper keeps two on the device at a time (the one running and the one it prefetches)."""
    swapped = (blocks_the_trainer_swaps(base, options.blocks_to_swap, sd_scripts_flux=options.sd_scripts_swap)
               if options.blocks_to_swap > 0 else [])
    return swapped, sorted(swapped, key=lambda b: sum(p.numel() for p in b.parameters()))[-2:]


def _size(nbytes: int) -> str:
    """GiB for full-size models, MiB for the tiny ones (whose plans are all below 0.1 GiB)."""
    return f"{nbytes / GIB:7.2f} GiB" if abs(nbytes) >= GIB / 10 or nbytes == 0 else f"{nbytes / 2**20:7.2f} MiB"


def _row(line: Line) -> str:
    params = (f"{line.params / 1e9:.2f}B" if line.params >= 1e8 else
              f"{line.params / 1e6:.1f}M" if line.params >= 1e5 else f"{line.params / 1e3:.1f}K" if line.params
              else "")
    return f"    {line.what:<60} {params:>7} {line.precision:>5} {_size(line.nbytes)}"


def format_plan(plan: MemoryPlan, device_memory: int | None, measured: int | None = None,
                host_memory: int | None = None) -> str:
    """The plan phase by phase (device, then host memory), the peaks, and the verdicts for ``device_memory`` and
    ``host_memory`` (default: this machine's)."""
    rows = ["memory plan: estimated peak memory of each phase"]
    for phase in plan.phases:
        rows.append(f"  {phase.name}: on the device")
        rows += [_row(line) for line in phase.device]
        rows.append(f"    {'device total':<60} {'':>7} {'':>5} {_size(phase.device_total)}")
        if phase.host:
            rows.append("    in host memory:")
            rows += [_row(line) for line in phase.host]
            rows.append(f"    {'host total':<60} {'':>7} {'':>5} {_size(phase.host_total)}")
    busiest = max(plan.phases, key=lambda phase: phase.device_total)
    rows.append(f"  peak device memory {_size(plan.total).strip()} ({busiest.name}); "
                f"peak host memory {_size(plan.host_total).strip()}")
    if measured is not None:
        rows.append(f"  measured peak {_size(measured).strip()}")
    if device_memory is not None:
        verdict = "fits" if fits(plan, device_memory) else "does NOT fit"
        rows.append(f"  device memory {device_memory / GIB:.1f} GiB, {RESERVE_BYTES / GIB:.0f} GiB kept for "
                    f"workspaces and fragmentation ({usable(device_memory) / GIB:.1f} GiB usable): {verdict}")
    host_memory = host_memory if host_memory is not None else detected_host_memory()
    if host_memory is not None:
        enough = plan.host_total <= host_memory - HOST_RESERVE_BYTES
        rows.append(f"  host memory {host_memory / GIB:.1f} GiB, {HOST_RESERVE_BYTES / GIB:.0f} GiB kept for the "
                    f"system and this process: {'enough' if enough else 'NOT enough'}"
                    + ("" if enough else " (fewer --blocks_to_swap, or quantized encoders, hold less there)"))
    return "\n".join(rows)


def detected_host_memory() -> int | None:
    """This machine's physical memory, or ``None`` where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def detected_device_memory() -> int | None:
    """The free memory of the current CUDA device, as the driver reports it once this process's CUDA context exists
    (a display, other processes and the context itself are already out), or ``None`` without one."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info(torch.cuda.current_device())[0]
    return None


def usable(device_memory: int) -> int:
    """What the plan's tensors may take of ``device_memory`` (free memory, or the card's as the user gives it)."""
    return device_memory - RESERVE_BYTES


def fits(plan: MemoryPlan, device_memory: int) -> bool:
    return plan.total <= usable(device_memory)


# The resolutions tried, downwards, when no memory option alone brings a run under the card (a multiple of 64, which
# every trainer's bucketing takes).
RESOLUTION_STEP = 64


def options_that_fit(estimate: Callable[[PlanOptions], MemoryPlan], options: PlanOptions, device_memory: int,
                     *, max_blocks: int, cuda: bool, has_long_text_encoder: bool = False,
                     can_offload_checkpointing: bool = False) -> list[tuple[str, MemoryPlan]]:
    """Changes of the memory options that bring the estimate under the card's usable memory, in the order
    that costs least speed and quality: each single change that fits; if none does, the changes together,
    then with the fewest swapped blocks that fit, then with every block but one swapped at the highest resolution
    that fits. ``[]`` when nothing fits."""
    steps: list[tuple[str, dict[str, Any]]] = []
    if options.encoders_on_device:
        steps.append(("encoders off the device (cached latents and text)", {"encoders_on_device": False}))
    if not options.gradient_checkpointing:
        steps.append(("--gradient_checkpointing", {"gradient_checkpointing": True}))
    if has_long_text_encoder and options.text_encoder_quantization == "none":
        steps.append(("--text_encoder_quantization int8", {"text_encoder_quantization": "int8"}))
    if can_offload_checkpointing and not options.cpu_offload_checkpointing:
        steps.append(("--cpu_offload_checkpointing", {"gradient_checkpointing": True,
                                                      "cpu_offload_checkpointing": True}))
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
    swapped = replace(together, blocks_to_swap=max_blocks)
    for resolution in range(options.resolution - RESOLUTION_STEP, 0, -RESOLUTION_STEP):
        plan = estimate(replace(swapped, resolution=resolution))
        if fits(plan, device_memory):
            return [(" + ".join(names + [f"--blocks_to_swap {max_blocks}", f"--resolution {resolution}"]), plan)]
    return []


def suggestion_lines(found: list[tuple[str, MemoryPlan]]) -> str:
    if not found:
        return "  nothing among dreamstep's memory options fits this card; lower --resolution or the batch size"
    return "\n".join(f"  would fit: {flags} ({plan.total / GIB:.2f} GiB)" for flags, plan in found)
