"""AdamW step time and peak memory over a FLUX.1-dev LoRA's tensors: torch's three implementations and the
one dreamstep picks, against the reference (what ``torch.optim.AdamW(params)`` picks on this device), in one run.

The LoRA's shapes are read from FLUX.1-dev's transformer built on the meta device with the trainer's layer
preset and rank; the tensors themselves are fp32 on the device, with random gradients (the step's cost does
not depend on their values). On a CPU torch's default is the per-tensor loop; on CUDA it is ``foreach``.

    python benchmarks/optimizer_step.py                               # rank 16, attention (the seed's LoRA)
    python benchmarks/optimizer_step.py --rank 64 --layers all-linear --device cuda
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from diffusers import FluxTransformer2DModel
from flux_lora import FULL_TRANSFORMER
from measure import time_steps

from dreamstep.engine.optim import FUSED_ADAMW_DEVICES, build_optimizer
from dreamstep.lora.inject import add_lora
from dreamstep.models.flux.lora_targets import FLUX_LORA_PRESETS, flux_lora_targets


def lora_shapes(rank: int, layers: str) -> list[torch.Size]:
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FULL_TRANSFORMER)
    add_lora(transformer, flux_lora_targets(transformer, [layers]), rank=rank, alpha=rank)
    return [p.shape for name, p in transformer.named_parameters() if "lora_" in name]


def optimizers(device: torch.device) -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    choices = {
        "reference (torch's default)": lambda params: torch.optim.AdamW(params, lr=1e-4),
        "per-tensor loop": lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=False),
        "foreach": lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=True),
        "dreamstep (build_optimizer)": lambda params: build_optimizer("AdamW", params, 1e-4),
    }
    if device.type in FUSED_ADAMW_DEVICES:
        choices["fused"] = lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True)
    return choices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", default="attention", choices=list(FLUX_LORA_PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = lora_shapes(args.rank, args.layers)
    print(f"FLUX.1-dev LoRA rank {args.rank} on '{args.layers}': {len(shapes)} tensors, "
          f"{sum(s.numel() for s in shapes) / 1e6:.1f}M parameters; {args.steps} timed steps on {device}")
    reference_seconds = None
    for label, make in optimizers(device).items():
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device)
        optimizer = make(params)
        seconds, peak_mib = time_steps(optimizer.step, args.steps, warmup=2, device=device)
        reference_seconds = reference_seconds or seconds
        print(f"{label:<30} {seconds * 1e3:8.1f} ms/step  peak {peak_mib:8.0f} MiB  "
              f"x{reference_seconds / seconds:5.2f} vs reference")
        del optimizer, params


if __name__ == "__main__":
    main()
