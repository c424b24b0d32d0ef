"""A quantized frozen base (``--base_quantization``) and T5 (``--text_encoder_quantization``), loaded
through diffusers' and transformers' own ``quantization_config``; LoRA / ControlNet weights stay fp32.

One backend per mode, chosen by measurement (``benchmarks/quantized_base.py``: a FLUX transformer of 2 double
+ 4 single blocks at width 768, rank-16 LoRA on the attention, 256 + 64 tokens, AdamW, bf16 autocast; torch
2.13 CPU, diffusers 0.42.1, torchao 0.18, optimum-quanto 0.2.7):

- int8 and fp8: torchao (``Int8WeightOnlyConfig``, ``Float8WeightOnlyConfig`` through ``TorchAoConfig``).
  Both torchao and optimum-quanto train here with losses within 0.001 of the unquantized base at every
  step. On the shared development CPU the step times were int8 70 s (torchao) vs 71 s (quanto), fp8 55 s vs
  48 s, unquantized 37 s: equal within that machine's noise (load average about 11 on 2 cores). torchao
  wins on what is not noise: one package serves both modes, peft wraps its layers with its own torchao
  LoRA layer (quanto's ``QLinear`` gets the generic one), the layers stay ``nn.Linear``, and on CUDA its
  weight-only kernels are the ones diffusers documents for training.
- nf4: bitsandbytes 4-bit NF4 (``BitsAndBytesConfig``), the only NF4 in diffusers' loaders. It needs a CUDA
  GPU (diffusers refuses it without one), so it is refused on other devices before any model loads.

Only the linear layers' weights are quantized; norms, embeddings and biases stay in the
``--mixed_precision`` dtype. peft adds its LoRA layers around the quantized linears, so the saved LoRA
has exactly the keys of one trained on the unquantized base and loads on it.

A frozen torchao linear computes with a dequantized copy of its weight, and autograd keeps that copy (2 bytes
per weight in bf16) from the forward until backward ends (in a gradient-checkpointed block, from its
recomputation until its backward ends): without checkpointing, more than the quantization saves. Backward only
needs ``grad_input = grad_output @ W`` (a frozen weight gets no gradient), so
:func:`keep_only_quantized_weights` gives each such linear a forward that keeps the quantized weight itself for
backward and dequantizes it again there. The same forward hands the layer its input in autocast's dtype, as autocast
does a plain linear's: torchao's and bitsandbytes' linears return their input's dtype, so a fp32 input (CUDA's
autocast keeps the norms' outputs in fp32) would make the residual stream fp32, and torchao's int8 would first
dequantize its weight to fp32 (6 bytes per weight per matmul instead of 2).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dreamstep.models.precision import in_compute_dtype


def diffusers_config(mode: str, compute_dtype: torch.dtype) -> Any:
    """The diffusers ``quantization_config`` of a transformer / UNet for ``mode`` (``None`` for none)."""
    import diffusers

    return _library_config(diffusers, mode, compute_dtype)


def transformers_config(mode: str, compute_dtype: torch.dtype) -> Any:
    """The transformers ``quantization_config`` of a text encoder for ``mode`` (``None`` for none)."""
    import transformers

    return _library_config(transformers, mode, compute_dtype)


def _library_config(library: Any, mode: str, compute_dtype: torch.dtype) -> Any:
    """diffusers and transformers each have their own ``BitsAndBytesConfig`` and ``TorchAoConfig`` classes,
    with the same arguments."""
    if mode == "none":
        return None
    if mode == "nf4":
        return library.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=compute_dtype)
    return library.TorchAoConfig(torchao_weight_config(mode))


def torchao_weight_config(mode: str) -> Any:
    """torchao's weight-only config of ``mode`` ("int8" or "fp8"), as the loaders above pass it."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return Int8WeightOnlyConfig() if mode == "int8" else Float8WeightOnlyConfig()


def pipeline_config(components: dict[str, str], compute_dtype: torch.dtype) -> Any:
    """A ``PipelineQuantizationConfig`` quantizing each named component (``{"transformer": "int8",
    "text_encoder_2": "fp8"}``) through its library's config; ``None`` when nothing is quantized."""
    from diffusers.quantizers import PipelineQuantizationConfig

    mapping = {}
    for name, mode in components.items():
        make = transformers_config if name.startswith("text_encoder") else diffusers_config
        config = make(mode, compute_dtype)
        if config is not None:
            mapping[name] = config
    return PipelineQuantizationConfig(quant_mapping=mapping) if mapping else None


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the values of a (possibly) quantized weight, as the layer computes with them."""
    if hasattr(tensor, "quant_state"):  # a bitsandbytes 4-bit parameter
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(tensor.data, tensor.quant_state)
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "dequantize"):
        return tensor.dequantize()
    return tensor


def quantize_built_model(model: torch.nn.Module, mode: str, double_quant: bool = False) -> None:
    """Quantize the linear weights of a model built from its config (benchmarks, tests) in place, as
    ``--base_quantization`` loads them: torchao's weight-only int8 / fp8, or bitsandbytes NF4 ``Linear4bit``
    layers quantized where the weights are (bf16 compute; ``double_quant`` also quantizes the absmax
    statistics). Each ``Params4bit`` knows its module, so the module can find its quantization state."""
    if mode in ("int8", "fp8"):
        from torchao.quantization import quantize_

        quantize_(model, torchao_weight_config(mode))
        keep_only_quantized_weights(model)
    elif mode == "nf4":
        import bitsandbytes as bnb

        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=torch.bfloat16, compress_statistics=double_quant,
                                              quant_type="nf4", device="meta")
                    layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                     compress_statistics=double_quant, module=layer)
                    if child.bias is not None:
                        layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                    setattr(parent, name, layer.to(child.weight.device))
        keep_only_quantized_weights(model)
    elif mode != "none":
        raise ValueError(f"unknown quantization mode {mode!r}")


def quantize_single_file_model(model: nn.Module, mode: str, compute_dtype: torch.dtype) -> None:
    """Quantize a model that diffusers' ``from_single_file`` loaded: it leaves a torchao ``quantization_config``
    unapplied and keeps weights stored in fp8 in fp8. Every fp8 weight becomes ``compute_dtype`` and each linear
    is quantized as ``mode`` says, one linear at a time, so that beside the quantized layers at most one layer is
    ever held in ``compute_dtype`` (a file's fp8 weights never exist as a whole bf16 model)."""
    from torchao.quantization import quantize_

    if mode not in ("none", "int8", "fp8"):
        raise ValueError(f"a single-file model cannot be quantized as {mode!r}")
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dtype.itemsize == 1 and param.is_floating_point():
                setattr(module, name, nn.Parameter(param.data.to(compute_dtype), requires_grad=False))
        if mode != "none" and type(module) is nn.Linear:
            quantize_(module, torchao_weight_config(mode))


class FrozenWeightLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` (or ``compute(x)``, the layer's own forward, when given) for a weight and bias
    that get no gradient; backward keeps ``weight`` as it is stored (quantized) through ``save_for_backward``, where
    gradient checkpointing and block swapping can let it go, and computes ``grad_x`` from its dequantized values."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                compute: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.input_dtype = x.dtype
        if compute is not None:
            return compute(x)
        return torch.nn.functional.linear(x, weight, bias)  # the layer's own op, under the caller's autocast

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (weight,) = ctx.saved_tensors
        values = dequantized(weight)
        return (grad_output.to(values.dtype) @ values).to(ctx.input_dtype), None, None, None


def _linear_keeping_the_stored_weight(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # The module's weight at call time: block swapping puts a new weight object in place for each run.
    weight, bias = module.weight, module.bias
    own_forward = type(module).forward  # bitsandbytes' Linear4bit: its 4-bit matmul; torchao's: F.linear
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return own_forward(module, x)
    # The input in autocast's dtype, as autocast gives a plain linear's: torchao's linear (through
    # __torch_function__) and bitsandbytes' 4-bit one run outside autocast and return their input's dtype, so an
    # fp32 input (a norm's output, which CUDA's autocast keeps in fp32) would make the residual stream fp32, and
    # torchao's int8 would make an fp32 copy of the weight before autocast's bf16 one.
    x = in_compute_dtype(x, x.device.type)
    return FrozenWeightLinear.apply(x, weight, bias, functools.partial(own_forward, module))


def _is_4bit(weight: torch.Tensor) -> bool:
    bnb = sys.modules.get("bitsandbytes")  # without it imported, no Params4bit exists
    return bnb is not None and isinstance(weight, bnb.nn.Params4bit)


def keep_only_quantized_weights(model: nn.Module) -> int:
    """Give every linear of ``model`` whose weight is a torchao tensor or a bitsandbytes 4-bit one a forward whose
    backward keeps only the quantized weight; return how many. A torchao linear's own autograd would keep a
    dequantized copy; bitsandbytes' 4-bit matmul keeps its weight and quantization state as attributes of its
    autograd node, out of gradient checkpointing's reach, so every swapped block's device buffer would stay alive
    until backward reached it. peft's LoRA layers call their base layer, so LoRA added later goes through it too."""
    from torchao.utils import TorchAOBaseTensor

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)
               and (isinstance(m.weight, TorchAOBaseTensor) or _is_4bit(m.weight))]
    for linear in linears:
        linear.forward = functools.partial(_linear_keeping_the_stored_weight, linear)
    return len(linears)
