"""The memory plan's training-pass estimate (meta device, no weights) against the same training step run for
real, with and without gradient checkpointing, for each base quantization mode.

The real step runs a FLUX transformer with random bf16 weights (quantized as the trainer loads them) and a
rank-16 fp32 attention LoRA, fed bf16 inputs under bf16 autocast as the trainer's step casts its cached ones; its
peak is measured twice: with the plan's own ``LiveTensorBytes`` (every tensor the step creates, alive at once),
and by the process: on CUDA the allocator's peak above what was allocated before the step
(``torch.cuda.max_memory_allocated``), on a CPU the peak resident memory above the resident memory before
it. The CPU column also holds what the CPU kernels allocate outside tensors (work buffers of the bf16
matmuls and of attention; measured here at 1.7x the estimate at width 3072 without checkpointing, 2.6x
with it), so on a CPU only the tensors column checks the plan; on a GPU the allocator column does. Then
the full-size plan rows for FLUX.1-dev LoRA at 1024 px.

    python benchmarks/memory_plan_check.py                  # tiny width and FLUX.1 width (3072), 2+4 blocks
    python benchmarks/memory_plan_check.py --resolution 1024   # on a GPU
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel
from measure import PeakMemory, process_status_mib
from peft import LoraConfig, inject_adapter_in_model

from dreamstep.models import memory_plan as mp
from dreamstep.models.flux.meta import training_pass
from dreamstep.models.plans import Estimator
from dreamstep.models.published_configs import FLUX_DEV_TRANSFORMER
from dreamstep.models.quantization import diffusers_config, keep_only_quantized_weights


def measured_peaks(folder: Path, mode: str, resolution: int, batch: int, text_tokens: int,
                   checkpointing: bool) -> tuple[int, float]:
    """Bytes of the step's peak as ``LiveTensorBytes`` counts them, and MiB as the process measures them, for
    the transformer in ``folder`` loaded with its linear weights quantized as ``mode`` says (as the trainer
    loads it)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.bfloat16,
                                                   quantization_config=diffusers_config(mode, torch.bfloat16))
    keep_only_quantized_weights(model)
    model.to(device).requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=["attn.to_q", "attn.to_k", "attn.to_v",
                                                                            "attn.to_out.0"]), model)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # LoRA weights train in fp32
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    with torch.device(device):
        step = training_pass(model, resolution=resolution, batch=batch, text_tokens=text_tokens)  # bf16 inputs
        with torch.autocast(device.type, dtype=torch.bfloat16):
            step().backward()  # a first step loads kernels and thread pools; the second is measured
        _release_cached(device)
        before_mib = _current_mib(device)
        with PeakMemory(device) as process, mp.LiveTensorBytes(mp.tensors_of(model)) as tracker:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = step()
            loss.backward()
    return tracker.peak, process.peak_mib - before_mib


def _release_cached(device: torch.device) -> None:
    """Hand freed memory back (CUDA's cache; glibc's free lists), so the peak counts only the step's own."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _current_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated() / 2**20
    return process_status_mib("VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--text_tokens", type=int, default=128)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 3072])
    parser.add_argument("--modes", nargs="+", default=["none", "fp8", "int8"], help="base quantization modes")
    args = parser.parse_args()
    process = "allocator MiB" if torch.cuda.is_available() else "RSS MiB"
    print(f"{'model':<40} {'checkpointing':>13} {'estimated MiB':>14} {'tensors MiB':>12} {'ratio':>6} "
          f"{process:>14} {'ratio':>6}")
    for width in args.widths:
        config = dict(FLUX_DEV_TRANSFORMER, num_layers=2, num_single_layers=4, num_attention_heads=width // 128)
        with tempfile.TemporaryDirectory() as tmp:
            FluxTransformer2DModel.from_config(config).to(torch.bfloat16).save_pretrained(Path(tmp) / "transformer")
            estimator = Estimator("flux", tmp, rank=16, device_type="cuda" if torch.cuda.is_available() else "cpu")
            for mode in args.modes:
                for checkpointing in (False, True):
                    estimated = estimator.activations(args.resolution, args.batch, checkpointing, args.text_tokens,
                                                      mode)
                    tensors, process_mib = measured_peaks(Path(tmp), mode, args.resolution, args.batch,
                                                          args.text_tokens, checkpointing)
                    estimated_mib = estimated / 2**20
                    print(f"{f'FLUX 2+4 blocks, width {width}, {args.resolution}px, {mode}':<40} "
                          f"{str(checkpointing):>13} {estimated_mib:14.1f} {tensors / 2**20:12.1f} "
                          f"{estimated / tensors:6.2f} {process_mib:14.1f} {estimated_mib / process_mib:6.2f}")
    print("\nFLUX.1-dev LoRA, 1024 px, batch 1, rank 16, gradient checkpointing (device GiB per phase):")
    full = Estimator("flux", None, rank=16)
    for mode in ("none", "fp8", "int8", "nf4"):
        for swap in (0, 30):
            plan = full(mp.PlanOptions(base_quantization=mode, blocks_to_swap=swap))
            phases = ", ".join(f"{p.name} {p.device_total / mp.GIB:.2f}" for p in plan.phases)
            print(f"  base {mode:<5} blocks_to_swap {swap:>2}: peak {plan.total / mp.GIB:6.2f} GiB ({phases}); "
                  f"host {plan.host_total / mp.GIB:.2f} GiB")


if __name__ == "__main__":
    main()
