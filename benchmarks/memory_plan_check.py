"""The memory plan's activation estimate (meta device, no weights) against the same training step run for
real, with and without gradient checkpointing.

The real step runs a FLUX transformer with random bf16 weights and a rank-16 attention LoRA; its peak is
measured with the plan's own ``LiveTensorBytes`` (every tensor the step creates, alive at once: on a GPU
this is what ``torch.cuda.max_memory_allocated`` counts above the weights), and on CUDA also with the
allocator's peak. Then the full-size plan rows for FLUX.1-dev LoRA at 1024 px.

    python benchmarks/memory_plan_check.py                  # tiny width and FLUX.1 width (3072), 2+4 blocks
    python benchmarks/memory_plan_check.py --resolution 1024   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig, inject_adapter_in_model

from dreamstep.models import memory_plan as mp
from dreamstep.models.plans import Estimator, _flux_step
from dreamstep.models.published_configs import FLUX_DEV_TRANSFORMER


def measured_peak(config: dict, resolution: int, batch: int, text_tokens: int, checkpointing: bool) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device), mp.default_dtype(torch.bfloat16):
        model = FluxTransformer2DModel.from_config(config)
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=["attn.to_q", "attn.to_k", "attn.to_v",
                                                                            "attn.to_out.0"]), model)
    model.to(torch.bfloat16)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    with torch.device(device):
        step = _flux_step(model, resolution, batch, text_tokens)
        with mp.LiveTensorBytes(mp.tensors_of(model)) as tracker:
            step().backward()
    return tracker.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--text_tokens", type=int, default=128)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 3072])
    args = parser.parse_args()
    print(f"{'model':<34} {'checkpointing':>13} {'estimated MiB':>14} {'measured MiB':>13} {'ratio':>6}")
    for width in args.widths:
        config = dict(FLUX_DEV_TRANSFORMER, num_layers=2, num_single_layers=4, num_attention_heads=width // 128)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "transformer").mkdir()
            (Path(tmp) / "transformer" / "config.json").write_text(json.dumps(config))
            estimator = Estimator("flux", tmp, rank=16)
        for checkpointing in (False, True):
            estimated = estimator.activations(args.resolution, args.batch, checkpointing, args.text_tokens)
            measured = measured_peak(config, args.resolution, args.batch, args.text_tokens, checkpointing)
            print(f"{f'FLUX 2+4 blocks, width {width}, {args.resolution}px':<34} {str(checkpointing):>13} "
                  f"{estimated / 2**20:14.1f} {measured / 2**20:13.1f} {estimated / measured:6.2f}")
    print("\nFLUX.1-dev LoRA, 1024 px, batch 1, rank 16, gradient checkpointing, encoders off the device:")
    full = Estimator("flux", None, rank=16)
    for mode in ("none", "fp8", "int8", "nf4"):
        for swap in (0, 30):
            plan = full(mp.PlanOptions(base_quantization=mode, blocks_to_swap=swap))
            print(f"  base {mode:<5} blocks_to_swap {swap:>2}: {plan.total / mp.GIB:6.2f} GiB")


if __name__ == "__main__":
    main()
