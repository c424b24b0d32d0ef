"""Host memory of ``--blocks_to_swap`` on FLUX.1-dev: the swapped weights' bytes against what pinning them
costs, per base dtype. torch's pinned (CUDA host) allocator rounds every allocation up to a power of two,
so the three ways of pinning compared here differ only in what they allocate:

- per tensor: each plain tensor (each torchao inner tensor) pinned on its own (dreamstep before issue 20);
- per block: each block's bytes as one pinned buffer;
- BlockSwapper: the bytes laid end to end and cut into power-of-two chunks (``host_bytes_for``).

Built on the meta device from the published config, so it runs anywhere in seconds and copies nothing.

    python benchmarks/pinned_host_memory.py                   # 40 and 56 swapped blocks, bf16 / int8 / fp8
    python benchmarks/pinned_host_memory.py --blocks 19 57
"""

from __future__ import annotations

import argparse

import torch
from diffusers import FluxTransformer2DModel
from flux_lora import FULL_TRANSFORMER

from dreamstep.models.blocks import host_bytes_for, repeated_blocks, stored_tensors
from dreamstep.models.precision import freeze
from dreamstep.models.quantization import quantize_built_model

GIB = 2**30


def pinned(nbytes: int) -> int:
    """What torch's pinned allocator reserves for ``nbytes``: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def report(mode: str, blocks: list[torch.nn.Module]) -> str:
    parts = [stored_tensors(block) for block in blocks]
    weights = sum(p.nbytes for block in parts for p in block)
    per_tensor = sum(pinned(p.nbytes) for block in parts for p in block)
    per_block = sum(pinned(sum(p.nbytes for p in block)) for block in parts)
    swapper = host_bytes_for(blocks)
    return (f"  {mode:<5}{len(blocks):>7}{weights / GIB:>10.2f}"
            + "".join(f"{b / GIB:>9.2f} ({b / weights:.3f}x)" for b in (per_tensor, per_block, swapper)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[40, 56], help="swapped blocks (of 57)")
    parser.add_argument("--modes", nargs="+", choices=["bf16", "int8", "fp8"], default=["bf16", "int8", "fp8"])
    args = parser.parse_args()
    print("FLUX.1-dev transformer, the last N blocks swapped: host memory in GiB (x the weights' bytes)")
    print(f"  {'mode':<5}{'blocks':>7}{'weights':>10}{'per tensor':>18}{'per block':>18}{'BlockSwapper':>18}")
    for mode in args.modes:
        with torch.device("meta"):
            model = FluxTransformer2DModel(**FULL_TRANSFORMER).to(torch.bfloat16)
        freeze(model)
        quantize_built_model(model, mode if mode != "bf16" else "none")
        every = repeated_blocks(model)
        for count in args.blocks:
            print(report(mode, every[len(every) - count:]))


if __name__ == "__main__":
    main()
